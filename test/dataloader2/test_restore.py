"""checkpoint()/restore() through DataLoader2's API, in this process: what a user sees."""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any

import pytest
from pipelines import double, pipeline, rs, take, tiny, unseeded_noise
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot import (
    BatchingOptions,
    IncompatibleCheckpointError,
    InvalidCheckpointError,
    MultiProcessingReadingService,
    ReplayDivergenceError,
)
from torchdata_snapshot.checkpoint import Checkpoint


def restored(make_dl: Any, state: Any, service: Any = None) -> DataLoader2:
    dl = DataLoader2.from_state(state, service if service is not None else rs(2))
    make_dl.created.append(dl)  # shut down with the test's other loaders
    return dl


@pytest.fixture
def make_dl(make_dl: Any) -> Any:  # type: ignore[override]
    created = []

    def make(*args: Any, **kwargs: Any) -> Any:
        dl = make_dl(*args, **kwargs)
        created.append(dl)
        return dl

    make.created = created  # type: ignore[attr-defined]
    yield make
    for dl in created:
        dl.shutdown()


def test_the_service_is_checkpointable() -> None:
    from torchdata.dataloader2.reading_service import CheckpointableReadingServiceInterface

    assert isinstance(MultiProcessingReadingService(), CheckpointableReadingServiceInterface)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_before_any_epoch_restores_to_a_fresh_start(make_dl: Any, num_workers: int) -> None:
    reference = make_dl(tiny(20), rs(num_workers))
    expected = [list(reference), list(reference)]
    dl = make_dl(tiny(20), rs(num_workers))
    state = dl.state_dict()
    assert state["reading_service_state"]["status"] == "idle"
    again = restored(make_dl, state, rs(num_workers))
    assert [list(again), list(again)] == expected


def test_the_reading_service_state_is_plain_small_and_checkable(make_dl: Any) -> None:
    dl = make_dl(tiny(40), rs(2))
    it = iter(dl)
    take(it, 5)
    plain = dl.state_dict()["reading_service_state"]
    assert Checkpoint.from_plain(plain).delivered == 5
    assert len(pickle.dumps(plain)) < 2000


def test_the_state_does_not_grow_with_the_position(make_dl: Any) -> None:
    for stateful in (False, True):  # with stateful restore, it holds a graph state per worker
        dl = make_dl(IterableWrapper(range(20_000)).sharding_filter().map(double), rs(2, stateful=stateful))
        it = iter(dl)
        take(it, 3_000)
        early = len(pickle.dumps(dl.state_dict()["reading_service_state"]))
        take(it, 15_000)
        late = len(pickle.dumps(dl.state_dict()["reading_service_state"]))
        assert late - early <= 16, "only the digits of the counters may grow"


@pytest.mark.parametrize("shape", ["shuffle_after_sharding", "non_replicable_tail"])
def test_the_main_process_keeps_no_marks_or_states_behind_what_it_may_need(make_dl: Any, shape: str) -> None:
    """Marks and graph states behind the user's position (or, when a main-process tail hides
    it, behind what was received) are dropped as they arrive: memory does not grow with k."""
    dl = make_dl(pipeline(shape, 6_000), rs(2, state_interval=16, batching=BatchingOptions(max_items=4)))
    it = iter(dl)
    take(it, 4_000)
    consumer = dl.reading_service._worker_consumer_datapipe
    window = consumer.window  # the items a worker may have sent ahead of the user
    for worker_id in range(2):
        assert len(consumer.marks[worker_id]) <= window
        assert len(consumer.states[worker_id]) <= window


def test_another_num_workers_is_refused_before_any_process_starts(make_dl: Any) -> None:
    dl = make_dl(tiny(20), rs(2))
    take(iter(dl), 3)
    state = dl.state_dict()
    children = set(multiprocessing.active_children())
    with pytest.raises(
        IncompatibleCheckpointError, match="num_workers=2, this reading service has num_workers=4"
    ):
        list(restored(make_dl, state, rs(4)))
    assert set(multiprocessing.active_children()) == children, "no worker was started for a misfit state"


def test_another_pipeline_is_refused(make_dl: Any) -> None:
    dl = make_dl(tiny(20), rs(2))
    take(iter(dl), 3)
    state = dl.state_dict()
    other = make_dl(pipeline("batch", 20), rs(2)).state_dict()
    state["serialized_datapipe"] = other["serialized_datapipe"]
    with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
        list(restored(make_dl, state))


def test_a_state_from_upstreams_reading_service_is_refused(make_dl: Any) -> None:
    from torchdata.dataloader2 import SequentialReadingService

    dl = make_dl(tiny(20), SequentialReadingService(rs(2)))
    take(iter(dl), 3)
    state = dl.state_dict()  # SequentialReadingService pickles a list of states: bytes
    state["reading_service_state"] = b"\x80\x04]\x94."
    with pytest.raises(InvalidCheckpointError, match="is bytes"):
        list(restored(make_dl, state))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pipeline_that_does_not_replay_is_detected(make_dl: Any, num_workers: int) -> None:
    datapipe = IterableWrapper(range(200)).sharding_filter().map(unseeded_noise)
    dl = make_dl(datapipe, rs(num_workers))
    take(iter(dl), 150)
    state = dl.state_dict()
    with pytest.raises(ReplayDivergenceError, match="not deterministic"):
        list(restored(make_dl, state, rs(num_workers)))
    unchecked = restored(make_dl, state, rs(num_workers, verify_replay=False))
    assert len(list(unchecked)) == 50


def test_load_state_dict_after_iteration_started_is_refused(make_dl: Any) -> None:
    dl = make_dl(tiny(10), rs(2))
    take(iter(dl), 2)
    with pytest.raises(RuntimeError, match="load_state_dict"):
        dl.load_state_dict(dl.state_dict())


def test_state_dict_after_shutdown_is_refused(make_dl: Any) -> None:
    from torchdata_snapshot import ReadingServiceClosedError

    dl = make_dl(tiny(10), rs(2))
    take(iter(dl), 2)
    dl.shutdown()
    with pytest.raises(ReadingServiceClosedError, match="shut down"):
        dl.state_dict()


def test_no_runtime_attribute_shadows_a_method(make_dl: Any) -> None:
    # A runtime attribute named like one of upstream's methods (``_resume``, ``_pause``, ...)
    # would silently replace it: DataLoader2 calls those by name.
    dl = make_dl(tiny(10), rs(2))
    take(iter(dl), 3)
    again = restored(make_dl, dl.state_dict())
    take(iter(again), 1)
    for service in (dl.reading_service, again.reading_service):
        for name in vars(service):
            assert not callable(getattr(type(service), name, None)), f"attribute {name} shadows a method"
