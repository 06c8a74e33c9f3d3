"""Stateful restore through the reading service: cost bounded whatever the position, same data
as replay, clear errors when it cannot be used."""

from __future__ import annotations

import subprocess
import sys
import unittest
from pathlib import Path
from typing import Any

import pytest
from conftest import requires_fork, start_methods
from pipelines import CountingStateful, double, failing_counter, five_milliseconds, pipeline, rs, take
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2 import DataLoader2

from torchdata_snapshot import (
    MultiProcessingReadingService,
    StateCaptureError,
    StateRestoreError,
    register_state_functions,
)


def restore(state: Any, **options: Any) -> DataLoader2:
    return DataLoader2.from_state(state, rs(2, **options))


#: A training script as users write theirs: a DataPipe of their own without state methods,
#: made resumable by ``register_state_functions`` inside ``main()``. Under spawn and forkserver
#: the workers import the script anew (as ``__mp_main__``) without running ``main()``.
SCRIPT = '''
import sys
import warnings

warnings.simplefilter("ignore")
from torch.utils.data import IterDataPipe
from torchdata.dataloader2 import DataLoader2

from {service_module} import MultiProcessingReadingService
from {registry_module} import register_state_functions

N = 10_000


class Numbers(IterDataPipe):
    """0 .. n - 1, from ``start`` when a state was loaded; no state methods of its own."""

    def __init__(self, n):
        self.n = n
        self.start = 0
        self.position = 0

    def __iter__(self):
        self.position, self.start = self.start, 0
        while self.position < self.n:
            self.position += 1
            yield self.position - 1


def numbers_state(dp):
    return dict(position=dp.position)


def numbers_load(dp, state):
    dp.start = state["position"]


def reading_service(context):
    return MultiProcessingReadingService(
        num_workers=2, multiprocessing_context=context, stateful=True, max_items_between_captures=64
    )


def main(context, load):
    register_state_functions(Numbers, numbers_state, load)
    dl = DataLoader2(Numbers(N).sharding_filter(), reading_service=reading_service(context))
    dl.seed(0)
    it = iter(dl)
    head = [next(it) for _ in range(3_000)]
    state = dl.state_dict()
    dl.shutdown()
    assert all(w["state"] for w in state["reading_service_state"]["workers"]), "no state captured"
    again = DataLoader2.from_state(state, reading_service(context))
    try:
        it = iter(again)
        rest = [next(it)]
        snapshots = [s for s in again.reading_service.snapshot() if s.role == "worker"]
        assert all(s.stateful for s in snapshots), snapshots
        # Each worker had handed out 1_500 items, Numbers' 3_000 elements through the sharding
        # filter: loaded from a state, Numbers started again near element 3_000, not at 0.
        yields = [n for s in snapshots for key, n in s.datapipe_yields.items() if "Numbers" in key]
        assert len(yields) == 2 and max(yields) < 2_000, yields
        rest.extend(it)
    finally:
        again.shutdown()
    assert head + rest == list(range(N)), "the resumed epoch is not the uninterrupted one"
    print("resumed exactly")


if __name__ == "__main__":
    context, how = sys.argv[1], sys.argv[2]
    main(context, numbers_load if how == "module_level" else lambda dp, state: numbers_load(dp, state))
'''

#: How long a script may take (spawned workers import torch, twice).
SCRIPT_LIMIT_S = 240


def run_script(tmp_path: Path, context: str, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    modules = {
        "service_module": MultiProcessingReadingService.__module__,
        "registry_module": register_state_functions.__module__,
    }
    script.write_text(SCRIPT.format(**modules))
    return subprocess.run(
        [sys.executable, str(script), context, how], capture_output=True, text=True, timeout=SCRIPT_LIMIT_S
    )


class TestStatefulRestore(SuiteTestCase):
    def test_workers_report_whether_they_restore_from_states(self) -> None:
        for name, expected in [
            ("stateful_source", True),
            ("shuffle_after_sharding", True),
            ("dispatch", False),
        ]:
            dl = self.make_dl(pipeline(name, 40), rs(2))
            next(iter(dl))
            workers = [s for s in dl.reading_service.snapshot() if s.role == "worker"]
            assert all(s.stateful is expected for s in workers), name

    def test_a_restore_far_into_the_epoch_recomputes_only_a_bounded_stretch(self) -> None:
        n, k = 40_000, 15_000
        reference = list(self.make_dl(pipeline("stateful_source", n), rs(2, max_items_between_captures=64)))
        dl = self.make_dl(pipeline("stateful_source", n), rs(2, max_items_between_captures=64))
        it = iter(dl)
        take(it, k)
        state = dl.state_dict()
        again = restore(state, max_items_between_captures=64)
        try:
            it2 = iter(again)
            assert next(it2) == reference[k]
            snaps = again.reading_service.snapshot()
            pulled = [
                s.datapipe_states[key]["pulled"]
                for s in snaps
                for key in s.datapipe_states
                if "CountingStateful" in key
            ]
            # Each worker's source had produced ~2 * 2 * 7_500 = 30_000 items by the checkpoint.
            assert len(pulled) == 2 and max(pulled) < 2_000, f"recomputed {pulled} source items"
            assert [next(it2) for _ in range(100)] == reference[k + 1 : k + 101]
        finally:
            again.shutdown()

    def test_a_restore_early_in_the_epoch_recomputes_only_a_bounded_stretch(self) -> None:
        """Captures start after the first item and are paced by time, not by ``max_items_between_captures``
        (1,024 items, far beyond this position): 5 ms items are captured every item or two, and still
        every few items on a loaded machine, where a capture's CPU time can triple."""
        n, k = 400, 200

        def build() -> Any:
            return CountingStateful(n).sharding_filter().map(five_milliseconds)

        reference = list(self.make_dl(build(), rs(2)))
        dl = self.make_dl(build(), rs(2))
        it = iter(dl)
        take(it, k)
        state = dl.state_dict()
        positions = [w["state"]["position"] for w in state["reading_service_state"]["workers"]]
        assert min(positions) >= k // 2 - 20, f"states captured at {positions}, the workers at {k // 2}"
        again = restore(state)
        try:
            it2 = iter(again)
            assert next(it2) == reference[k]
            pulled = [
                s.datapipe_states[key]["pulled"]
                for s in again.reading_service.snapshot()
                for key in s.datapipe_states
                if "CountingStateful" in key
            ]
            # Each worker's source had produced ~2 * 100 items by the checkpoint.
            assert len(pulled) == 2 and max(pulled) < 60, f"recomputed {pulled} source items"
            assert list(it2) == reference[k + 1 :]
        finally:
            again.shutdown()

    def test_stateful_and_replay_restores_give_the_same_data(self) -> None:
        reference = list(self.make_dl(pipeline("shuffle_after_sharding", 500), rs(2)))
        for stateful, interval in [(True, 16), (False, 16), (None, 16)]:
            dl = self.make_dl(
                pipeline("shuffle_after_sharding", 500),
                rs(2, stateful=stateful, max_items_between_captures=interval),
            )
            it = iter(dl)
            head = take(it, 301)
            again = restore(dl.state_dict(), stateful=stateful, max_items_between_captures=interval)
            try:
                assert head + list(again) == reference, (stateful, interval)
            finally:
                again.shutdown()

    def test_stateful_true_names_the_datapipe_that_cannot_resume(self) -> None:
        from pipelines import NonReplicable  # noqa: F401  (the tail stays in the main process)
        from torchdata.datapipes.iter import IterableWrapper

        dl = self.make_dl(IterableWrapper(iter(range(10))).map(double), rs(2, stateful=True))
        with pytest.raises(
            StateCaptureError, match="stateful=True, but DataPipe .*IterableWrapperIterDataPipe can neither"
        ):
            list(dl)

    def test_stateful_true_refuses_a_dispatching_process(self) -> None:
        dl = self.make_dl(pipeline("dispatch", 20), rs(2, stateful=True))
        with pytest.raises(StateCaptureError, match="not available with sharding_round_robin_dispatch"):
            list(dl)

    def test_a_failing_load_state_dict_is_a_clear_error(self) -> None:
        dl = self.make_dl(CountingStateful(400).sharding_filter(), rs(2, max_items_between_captures=8))
        take(iter(dl), 100)
        state = dl.state_dict()
        failing = DataLoader2.from_state(state, rs(2))
        failing.datapipe = failing_counter(400).sharding_filter()
        try:
            with pytest.raises(
                StateRestoreError,
                match=r"load_state_dict\(\) of DataPipe \d+:CountingStateful .* another dataset",
            ):
                list(failing)
        finally:
            failing.shutdown()

    @pytest.mark.slow
    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    def test_state_functions_registered_in_main_reach_the_workers(self, context: str) -> None:
        done = run_script(self.tmp_path, context, "module_level")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "resumed exactly"

    @pytest.mark.slow
    @parametrize("context", start_methods("spawn", "forkserver"))
    def test_state_functions_that_cannot_reach_the_workers_are_refused_naming_them(
        self, context: str
    ) -> None:
        done = run_script(self.tmp_path, context, "lambda")
        assert done.returncode == 1
        assert "StateCaptureError" in done.stderr and "__main__.Numbers" in done.stderr, done.stderr
        assert "<lambda>" in done.stderr and "module level" in done.stderr, done.stderr

    @pytest.mark.slow
    @requires_fork
    def test_under_fork_state_functions_need_not_pickle(self) -> None:
        done = run_script(self.tmp_path, "fork", "lambda")  # the workers inherit them
        assert done.returncode == 0, done.stderr


instantiate_parametrized_tests(TestStatefulRestore)


if __name__ == "__main__":
    unittest.main()
