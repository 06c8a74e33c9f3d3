"""Self-healing (restart_dead_workers): a dead worker is replaced, replays its stream to what the
main process already has, and the run goes on with exactly the data it would have had."""

from __future__ import annotations

import multiprocessing
import os
import signal
import unittest
from functools import partial
from pathlib import Path
from typing import Any, Dict

import pytest
from faults import kill_always_at, kill_once_at, kill_once_at_reset, restarts_logged
from pipelines import double, megabyte, pipeline, rs, take, worker_processes
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, subtest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot import MultiProcessingReadingService, WorkerDiedError
from torchdata_snapshot.core.options import FaultOptions

RESTARTING = "worker [01] \\(pid \\d+\\) died \\(exit code -9 \\(SIGKILL\\)\\); restarting it"


def killing(marker: Path, k: int, n: int = 120) -> Any:
    return (
        IterableWrapper(range(n))
        .shuffle()
        .sharding_filter()
        .map(partial(kill_once_at, str(marker), k))
        .map(double)
    )


def two_epochs(dl: Any) -> Any:
    return [list(dl), list(dl)]


def tensors_killing(marker: Path, k: int, n: int = 40) -> Any:
    return (
        IterableWrapper(range(n)).sharding_filter().map(partial(kill_once_at, str(marker), k)).map(megabyte)
    )


class TestSelfHealing(SuiteTestCase):
    def test_the_option_is_a_keyword_whose_value_the_service_keeps(self) -> None:
        service = MultiProcessingReadingService(2, control_timeout_s=3.0, restart_dead_workers=2)
        assert service.fault_options == FaultOptions(3.0, None, restart_dead_workers=2)

    @parametrize("k", [0, 5, 60, 119])
    @parametrize("prefetch", [(0, 0), (10, 10)])
    @parametrize(
        "restore",
        [
            subtest({"stateful": False}, name="replay"),
            subtest({"max_items_between_captures": 8}, name="states"),
        ],
    )
    def test_a_killed_worker_is_replaced_and_the_data_is_exactly_the_same(
        self, k: int, prefetch: Any, restore: Dict[str, Any]
    ) -> None:
        config = dict(worker_prefetch_cnt=prefetch[0], main_prefetch_cnt=prefetch[1], **restore)
        reference = list(self.make_dl(killing(self.tmp_path / "absent", k), rs(2, **config)))
        marker = self.tmp_path / "kill"
        marker.touch()
        dl = self.make_dl(killing(marker, k), rs(2, restart_dead_workers=1, **config))
        with restarts_logged(RESTARTING):
            got = list(dl)
        assert not marker.exists(), "a worker really died"
        assert got == reference

    def test_kills_at_any_moment_between_items(self) -> None:
        # More items than the workers may run ahead (small items: up to 512 each), so that every
        # kill finds a worker with items still to produce.
        reference = list(self.make_dl(pipeline("global_rng", 3000), rs(2)))
        dl = self.make_dl(pipeline("global_rng", 3000), rs(2, restart_dead_workers=3))
        it = iter(dl)
        got = take(it, 10)
        with restarts_logged() as restarts:
            for victim, steps in [(0, 37), (1, 90), (0, 1)]:
                os.kill(dl.reading_service.snapshot()[victim].pid, signal.SIGKILL)
                got += take(it, steps)
            got += list(it)
        assert got == reference
        assert len(restarts) == 3
        snaps = dl.reading_service.snapshot()
        assert all(s.produced == s.received for s in snaps), "counts still add up after restarts"

    def test_a_worker_that_keeps_dying_is_given_up_on(self) -> None:
        dl = self.make_dl(
            IterableWrapper(range(50)).sharding_filter().map(partial(kill_always_at, 21)),
            rs(2, restart_dead_workers=2),
        )
        with (
            restarts_logged(),
            pytest.raises(WorkerDiedError, match="restarted 2 times this epoch already: giving up"),
        ):
            list(dl)

    def test_a_restart_during_a_snapshot_resends_the_request(self) -> None:
        reference = list(self.make_dl(pipeline("shuffle_after_sharding", 80), rs(2)))
        dl = self.make_dl(pipeline("shuffle_after_sharding", 80), rs(2, restart_dead_workers=1))
        it = iter(dl)
        got = take(it, 7)
        os.kill(dl.reading_service.snapshot()[1].pid, signal.SIGKILL)
        with restarts_logged():
            snaps = dl.reading_service.snapshot()
        assert sum(s.handed_on for s in snaps) == 7
        assert got + list(it) == reference

    def test_not_available_with_a_dispatching_process(self) -> None:
        dl = self.make_dl(pipeline("dispatch", 10), rs(2, restart_dead_workers=1))
        children = set(multiprocessing.active_children())
        with pytest.raises(
            ValueError, match="restart_dead_workers is not supported with sharding_round_robin_dispatch"
        ):
            iter(dl)
        assert set(multiprocessing.active_children()) == children, "refused before any process started"

    def test_a_worker_found_dead_when_sending_it_a_request_is_replaced(self) -> None:
        reference = list(self.make_dl(pipeline("shuffle_after_sharding", 80), rs(2)))
        dl = self.make_dl(pipeline("shuffle_after_sharding", 80), rs(2, restart_dead_workers=1))
        it = iter(dl)
        got = take(it, 7)
        victim = worker_processes(dl)[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)  # dead for sure: the request cannot even be written
        with restarts_logged():
            dl.reading_service.snapshot()
        assert got + list(it) == reference

    def test_a_worker_found_dead_when_granting_it_credit_is_replaced(self) -> None:
        # More items than a worker may run ahead (small items: up to 512), so that the main process
        # still has credit to grant the dead worker.
        reference = list(self.make_dl(pipeline("shuffle_after_sharding", 3000), rs(2)))
        dl = self.make_dl(pipeline("shuffle_after_sharding", 3000), rs(2, restart_dead_workers=1))
        it = iter(dl)
        got = take(it, 7)
        victim = worker_processes(dl)[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)  # dead for sure: the next credit for it cannot be written
        with restarts_logged():
            got += list(it)
        assert got == reference

    def test_a_worker_dead_between_epochs_is_replaced_when_the_next_epoch_starts(self) -> None:
        reference = two_epochs(self.make_dl(pipeline("global_rng", 100), rs(2)))
        dl = self.make_dl(pipeline("global_rng", 100), rs(2, restart_dead_workers=1))
        first = list(dl)
        victim = worker_processes(dl)[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)  # dead for sure: the epoch's reset cannot even be written
        with restarts_logged(RESTARTING):
            second = list(dl)
        assert [first, second] == reference

    def test_a_worker_dying_during_the_epoch_reset_is_replaced(self) -> None:
        marker = self.tmp_path / "kill"
        reset_fn = partial(kill_once_at_reset, str(marker))
        reference = two_epochs(self.make_dl(pipeline("global_rng", 100), rs(2, worker_reset_fn=reset_fn)))
        dl = self.make_dl(
            pipeline("global_rng", 100), rs(2, worker_reset_fn=reset_fn, restart_dead_workers=1)
        )
        first = list(dl)
        marker.touch()  # the next reset kills the first worker that reads it
        with restarts_logged(RESTARTING):
            second = list(dl)
        assert not marker.exists(), "a worker really died"
        assert [first, second] == reference

    @parametrize("stateful", [False, True], name_fn=lambda stateful: "from_state" if stateful else "replay")
    def test_a_worker_dying_during_the_replay_of_a_restore_is_replaced(self, stateful: bool) -> None:
        options = dict(stateful=stateful, max_items_between_captures=10)
        # The 70th item is replayed by any restore after it (a graph state is strictly behind the
        # user's position): the worker producing it dies there, once, when the marker exists.
        k = (
            list(self.make_dl(killing(self.tmp_path / "absent", 0), rs(2, **options)))[69] // 2
        )  # (killing() doubles)
        marker = self.tmp_path / "kill"
        dl = self.make_dl(killing(marker, k), rs(2, **options))
        it = iter(dl)
        take(it, 70)
        state, rest = dl.state_dict(), list(it)
        marker.touch()
        restored = DataLoader2.from_state(state, rs(2, restart_dead_workers=1, **options))
        try:
            with restarts_logged(RESTARTING):
                assert list(restored) == rest
        finally:
            restored.shutdown()
        assert not marker.exists(), "a worker really died"

    @parametrize(
        "tensor_pool", [False, True], name_fn=lambda pool: "tensor_pool" if pool else "shared_memory"
    )
    def test_tensors_in_flight_from_a_killed_worker_are_produced_again_by_its_replacement(
        self, tensor_pool: bool
    ) -> None:
        """Items holding tensors that a worker sent before it was killed, not read yet: their shared
        memory is handed over by the dead process's resource sharer (or sits in its pool). The
        replacement produces them again: the data is exactly the same, and no ConnectionError
        reaches the user."""
        config = dict(worker_prefetch_cnt=10, tensor_pool=tensor_pool)
        reference = [
            int(t[0]) for t in self.make_dl(tensors_killing(self.tmp_path / "absent", 21), rs(2, **config))
        ]
        marker = self.tmp_path / "kill"
        marker.touch()
        dl = self.make_dl(tensors_killing(marker, 21), rs(2, restart_dead_workers=1, **config))
        it = iter(dl)
        got = [int(next(it)[0])]
        doomed = worker_processes(dl)[1]  # item 21 is worker 1's 11th: items 1 .. 19 were sent before
        doomed.join(60)  # bounded: it kills itself at its 11th item, within its credit window
        assert doomed.exitcode == -signal.SIGKILL, "the worker died with unread items in its pipe"
        with restarts_logged(RESTARTING):
            got += [int(t[0]) for t in it]
        assert got == reference


instantiate_parametrized_tests(TestSelfHealing)


if __name__ == "__main__":
    unittest.main()
