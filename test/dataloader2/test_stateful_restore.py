"""Stateful restore through the reading service: cost bounded whatever the position, same data
as replay, clear errors when it cannot be used."""

from __future__ import annotations

from typing import Any

import pytest
from pipelines import CountingStateful, double, failing_counter, five_milliseconds, pipeline, rs, take
from torchdata.dataloader2 import DataLoader2

from torchdata_snapshot import StateCaptureError, StateRestoreError


def restore(state: Any, **options: Any) -> DataLoader2:
    return DataLoader2.from_state(state, rs(2, **options))


def test_workers_report_whether_they_restore_from_states(make_dl: Any) -> None:
    for name, expected in [("stateful_source", True), ("shuffle_after_sharding", True), ("dispatch", False)]:
        dl = make_dl(pipeline(name, 40), rs(2))
        next(iter(dl))
        workers = [s for s in dl.reading_service.snapshot() if s.role == "worker"]
        assert all(s.stateful is expected for s in workers), name


def test_a_restore_far_into_the_epoch_recomputes_only_a_bounded_stretch(make_dl: Any) -> None:
    n, k = 40_000, 15_000
    reference = list(make_dl(pipeline("stateful_source", n), rs(2, state_interval=64)))
    dl = make_dl(pipeline("stateful_source", n), rs(2, state_interval=64))
    it = iter(dl)
    take(it, k)
    state = dl.state_dict()
    again = restore(state, state_interval=64)
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


def test_a_restore_early_in_the_epoch_recomputes_only_a_bounded_stretch(make_dl: Any) -> None:
    """Captures start after the first item and are paced by time, not by ``state_interval``
    (1,024 items, far beyond this position): 5 ms items are captured every item or two, and still
    every few items on a loaded machine, where a capture's CPU time can triple."""
    n, k = 400, 200

    def build() -> Any:
        return CountingStateful(n).sharding_filter().map(five_milliseconds)

    reference = list(make_dl(build(), rs(2)))
    dl = make_dl(build(), rs(2))
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


def test_stateful_and_replay_restores_give_the_same_data(make_dl: Any) -> None:
    reference = list(make_dl(pipeline("shuffle_after_sharding", 500), rs(2)))
    for stateful, interval in [(True, 16), (False, 16), (None, 0)]:
        dl = make_dl(
            pipeline("shuffle_after_sharding", 500), rs(2, stateful=stateful, state_interval=interval)
        )
        it = iter(dl)
        head = take(it, 301)
        again = restore(dl.state_dict(), stateful=stateful, state_interval=interval)
        try:
            assert head + list(again) == reference, (stateful, interval)
        finally:
            again.shutdown()


def test_stateful_true_names_the_datapipe_that_cannot_resume(make_dl: Any) -> None:
    from pipelines import NonReplicable  # noqa: F401  (the tail stays in the main process)
    from torchdata.datapipes.iter import IterableWrapper

    dl = make_dl(IterableWrapper(iter(range(10))).map(double), rs(2, stateful=True))
    with pytest.raises(
        StateCaptureError, match="stateful=True, but DataPipe .*IterableWrapperIterDataPipe can neither"
    ):
        list(dl)


def test_stateful_true_refuses_a_dispatching_process(make_dl: Any) -> None:
    dl = make_dl(pipeline("dispatch", 20), rs(2, stateful=True))
    with pytest.raises(StateCaptureError, match="not available with sharding_round_robin_dispatch"):
        list(dl)


def test_a_failing_load_state_dict_is_a_clear_error(make_dl: Any) -> None:
    dl = make_dl(CountingStateful(400).sharding_filter(), rs(2, state_interval=8))
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
