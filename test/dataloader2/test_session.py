"""A session on its own: the epochs of a running graph, the checkpoint at the user's position,
a planned restore resumed by the next epoch, pause and snapshot; without DataLoader2."""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

import pytest
from pipelines import started_runtime
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._constants import NO_EPOCH
from torchdata_snapshot.checkpoint.format import Checkpoint
from torchdata_snapshot.checkpoint.identity import graph_identity
from torchdata_snapshot.checkpoint.restore_plan import PendingRestore, plan_restore
from torchdata_snapshot.checkpoint.seeds import seed_state
from torchdata_snapshot.core.session import Session, checkpoint_before_start

SIZE = 20


def graph() -> Any:
    return IterableWrapper(range(SIZE)).shuffle().sharding_filter()


def start(num_workers: int, epoch: int = NO_EPOCH, pending: Optional[PendingRestore] = None) -> Session:
    datapipe = graph()
    runtime, outlet = started_runtime(datapipe, num_workers)
    return Session(runtime, outlet, num_workers, graph_identity(datapipe), (1, 0), epoch, pending)


@pytest.fixture
def sessions() -> Iterator[List[Session]]:
    started: List[Session] = []
    yield started
    for session in started:
        session.runtime.shutdown(5.0)


@pytest.fixture(params=[0, 2], ids=["in_process", "two_workers"])
def num_workers(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def test_before_any_epoch_the_checkpoint_has_no_position(sessions: List[Session], num_workers: int) -> None:
    session = start(num_workers)
    sessions.append(session)
    state = session.checkpoint()
    assert state["epoch"] == NO_EPOCH and state["delivered"] == 0 and len(state["workers"]) == num_workers
    assert checkpoint_before_start(num_workers)["epoch"] == NO_EPOCH


def test_an_epoch_records_its_seeds_and_advances_the_generator(
    sessions: List[Session], num_workers: int
) -> None:
    session = start(num_workers)
    sessions.append(session)
    generator = SeedGenerator(7)
    at_start = seed_state(generator)
    session.start_epoch(generator, None)
    assert session.epoch == 0 and session.epoch_seed == at_start
    assert seed_state(generator) != at_start, "the next epoch gets other seeds"
    assert sorted(session.outlet) == list(range(SIZE))
    assert session.checkpoint()["status"] == "finished"


def test_the_checkpoint_records_what_the_user_received(sessions: List[Session], num_workers: int) -> None:
    session = start(num_workers)
    sessions.append(session)
    session.start_epoch(SeedGenerator(7), None)
    it = iter(session.outlet)
    [next(it) for _ in range(4)]
    state = session.checkpoint()
    assert state["epoch"] == 0 and state["delivered"] == 4 and state["status"] == "in_epoch"
    assert len(state["workers"]) == num_workers


def test_a_planned_restore_is_resumed_by_the_next_epoch_only(
    sessions: List[Session], num_workers: int
) -> None:
    saved = start(num_workers)
    sessions.append(saved)
    saved.start_epoch(SeedGenerator(7), None)
    it = iter(saved.outlet)
    head = [next(it) for _ in range(6)]
    state = Checkpoint.from_plain(saved.checkpoint())
    rest = list(it)

    datapipe = graph()
    pending = plan_restore(state, datapipe, graph_identity(datapipe), (1, 0), num_workers, False)
    assert pending is not None
    restored = start(num_workers, epoch=state.epoch - 1, pending=pending)
    sessions.append(restored)
    restored.start_epoch(SeedGenerator(123), None)  # the seeds are put back to the saved epoch's
    assert list(restored.outlet) == rest and len(head) == 6
    assert restored.pending is None and restored.epoch == 0
    restored.start_epoch(SeedGenerator(123), None)
    assert sorted(restored.outlet) == list(range(SIZE)), "the epoch after it starts afresh"


def test_a_paused_session_snapshots_as_paused_and_resumes(sessions: List[Session], num_workers: int) -> None:
    session = start(num_workers)
    sessions.append(session)
    session.start_epoch(SeedGenerator(7), None)
    it = iter(session.outlet)
    first = next(it)
    session.pause(None)
    assert session.paused and all(s.paused for s in session.snapshot())
    session.resume(None)
    assert not session.paused
    assert sorted([first, *it]) == list(range(SIZE))
