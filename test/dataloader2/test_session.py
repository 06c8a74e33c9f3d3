"""A session on its own: the epochs of a running graph, the checkpoint at the user's position,
a planned restore resumed by the next epoch, pause and snapshot; without DataLoader2."""

from __future__ import annotations

import unittest
from typing import Any, List, Optional

from pipelines import started_runtime
from suite_case import SuiteTestCase
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


class SessionTests:
    """The tests of sessions of ``num_workers`` workers (0: in this process), a mixin of the
    TestCase classes below (a TestCase of its own would be collected)."""

    num_workers = 0

    def setUp(self) -> None:
        super().setUp()
        self.sessions: List[Session] = []  # shut down after the test
        self.addCleanup(lambda: [session.runtime.shutdown(5.0) for session in self.sessions])

    def test_before_any_epoch_the_checkpoint_has_no_position(self) -> None:
        session = start(self.num_workers)
        self.sessions.append(session)
        state = session.checkpoint()
        assert (
            state["epoch"] == NO_EPOCH
            and state["delivered"] == 0
            and len(state["workers"]) == self.num_workers
        )
        assert checkpoint_before_start(self.num_workers)["epoch"] == NO_EPOCH

    def test_an_epoch_records_its_seeds_and_advances_the_generator(self) -> None:
        session = start(self.num_workers)
        self.sessions.append(session)
        generator = SeedGenerator(7)
        at_start = seed_state(generator)
        session.start_epoch(generator, None)
        assert session.epoch == 0 and session.epoch_seed == at_start
        assert seed_state(generator) != at_start, "the next epoch gets other seeds"
        assert sorted(session.outlet) == list(range(SIZE))
        assert session.checkpoint()["status"] == "finished"

    def test_the_checkpoint_records_what_the_user_received(self) -> None:
        session = start(self.num_workers)
        self.sessions.append(session)
        session.start_epoch(SeedGenerator(7), None)
        it = iter(session.outlet)
        [next(it) for _ in range(4)]
        state = session.checkpoint()
        assert state["epoch"] == 0 and state["delivered"] == 4 and state["status"] == "in_epoch"
        assert len(state["workers"]) == self.num_workers

    def test_a_planned_restore_is_resumed_by_the_next_epoch_only(self) -> None:
        saved = start(self.num_workers)
        self.sessions.append(saved)
        saved.start_epoch(SeedGenerator(7), None)
        it = iter(saved.outlet)
        head = [next(it) for _ in range(6)]
        state = Checkpoint.from_plain(saved.checkpoint())
        rest = list(it)

        datapipe = graph()
        pending = plan_restore(state, datapipe, graph_identity(datapipe), (1, 0), self.num_workers, False)
        assert pending is not None
        restored = start(self.num_workers, epoch=state.epoch - 1, pending=pending)
        self.sessions.append(restored)
        restored.start_epoch(SeedGenerator(123), None)  # the seeds are put back to the saved epoch's
        assert list(restored.outlet) == rest and len(head) == 6
        assert restored.pending is None and restored.epoch == 0
        restored.start_epoch(SeedGenerator(123), None)
        assert sorted(restored.outlet) == list(range(SIZE)), "the epoch after it starts afresh"

    def test_a_paused_session_snapshots_as_paused_and_resumes(self) -> None:
        session = start(self.num_workers)
        self.sessions.append(session)
        session.start_epoch(SeedGenerator(7), None)
        it = iter(session.outlet)
        first = next(it)
        session.pause(None)
        assert session.paused and all(s.paused for s in session.snapshot())
        session.resume(None)
        assert not session.paused
        assert sorted([first, *it]) == list(range(SIZE))


class TestSessionInProcess(SessionTests, SuiteTestCase):
    num_workers = 0


class TestSessionOfTwoWorkers(SessionTests, SuiteTestCase):
    num_workers = 2


if __name__ == "__main__":
    unittest.main()
