"""The checkpoint's session on its own: the checkpoint at the user's position, an epoch's seeds
recorded, a planned restore resumed by the next epoch; without DataLoader2."""

from __future__ import annotations

import unittest
from typing import Any, List

from pipelines import started_session
from suite_case import SuiteTestCase
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._constants import NO_EPOCH
from torchdata_snapshot.checkpoint.seeds import seed_state
from torchdata_snapshot.checkpoint.session import CheckpointSession, checkpoint_before_start

SIZE = 20


def graph() -> Any:
    return IterableWrapper(range(SIZE)).shuffle().sharding_filter()


class CheckpointSessionTests:
    """The tests of sessions of ``num_workers`` workers (0: in this process), a mixin of the
    TestCase classes below (a TestCase of its own would be collected)."""

    num_workers = 0

    def setUp(self) -> None:
        super().setUp()
        self.sessions: List[CheckpointSession] = []  # shut down after the test
        self.addCleanup(lambda: [session.runtime.shutdown(5.0) for session in self.sessions])

    def start(self, plan: Any = None) -> CheckpointSession:
        session = started_session(graph(), self.num_workers, CheckpointSession, plan)
        self.sessions.append(session)
        return session

    def test_before_any_epoch_the_checkpoint_has_no_position(self) -> None:
        session = self.start()
        state = session.checkpoint()
        assert (
            state["epoch"] == NO_EPOCH
            and state["delivered"] == 0
            and len(state["workers"]) == self.num_workers
        )
        assert CheckpointSession.before_start(self.num_workers) == checkpoint_before_start(self.num_workers)
        assert checkpoint_before_start(self.num_workers)["epoch"] == NO_EPOCH

    def test_an_epoch_records_its_seeds_and_advances_the_generator(self) -> None:
        session = self.start()
        generator = SeedGenerator(7)
        at_start = seed_state(generator)
        session.start_epoch(generator, None)
        assert session.epoch == 0 and session.epoch_seed == at_start
        assert seed_state(generator) != at_start, "the next epoch gets other seeds"
        assert sorted(session.outlet) == list(range(SIZE))
        assert session.checkpoint()["status"] == "finished"

    def test_the_checkpoint_records_what_the_user_received(self) -> None:
        session = self.start()
        session.start_epoch(SeedGenerator(7), None)
        it = iter(session.outlet)
        [next(it) for _ in range(4)]
        state = session.checkpoint()
        assert state["epoch"] == 0 and state["delivered"] == 4 and state["status"] == "in_epoch"
        assert len(state["workers"]) == self.num_workers

    def test_a_planned_restore_is_resumed_by_the_next_epoch_only(self) -> None:
        saved = self.start()
        saved.start_epoch(SeedGenerator(7), None)
        it = iter(saved.outlet)
        head = [next(it) for _ in range(6)]
        state = saved.checkpoint()
        rest = list(it)

        plan = CheckpointSession.plan(graph(), state, self.num_workers, False)
        assert plan.pending is not None and not plan.moved
        restored = self.start(plan)
        assert restored.epoch == NO_EPOCH and restored.pending is plan.pending
        restored.start_epoch(SeedGenerator(123), None)  # the seeds are put back to the saved epoch's
        assert list(restored.outlet) == rest and len(head) == 6
        assert restored.pending is None and restored.epoch == 0
        restored.start_epoch(SeedGenerator(123), None)
        assert sorted(restored.outlet) == list(range(SIZE)), "the epoch after it starts afresh"


class TestCheckpointSessionInProcess(CheckpointSessionTests, SuiteTestCase):
    num_workers = 0


class TestCheckpointSessionOfTwoWorkers(CheckpointSessionTests, SuiteTestCase):
    num_workers = 2


if __name__ == "__main__":
    unittest.main()
