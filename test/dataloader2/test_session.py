"""The core's session on its own: the epochs of a running graph, pause and snapshot, and no
checkpoint to take or restore; without DataLoader2."""

from __future__ import annotations

import unittest
import warnings
from typing import Any, List

from pipelines import started_session
from suite_case import SuiteTestCase
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.reading_service import MultiProcessingReadingService as TorchdataMPRS
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._errors import ReadingServiceError
from torchdata_snapshot.core.session import Session

SIZE = 20


def graph() -> Any:
    return IterableWrapper(range(SIZE)).shuffle().sharding_filter()


class SessionTests:
    """The tests of sessions of ``num_workers`` workers (0: in this process), a mixin of the
    TestCase classes below (a TestCase of its own would be collected)."""

    num_workers = 0

    def setUp(self) -> None:
        super().setUp()
        self.sessions: List[Session] = []  # shut down after the test
        self.addCleanup(lambda: [session.runtime.shutdown(5.0) for session in self.sessions])

    def start(self) -> Session:
        session = started_session(graph(), self.num_workers)
        self.sessions.append(session)
        return session

    def test_each_epoch_yields_the_whole_graph_once(self) -> None:
        session = self.start()
        for epoch in range(2):
            session.start_epoch(SeedGenerator(7), None)
            assert session.epoch == epoch
            assert sorted(session.outlet) == list(range(SIZE))
            assert session.outlet.finished and session.outlet.delivered == SIZE

    def test_it_takes_no_checkpoint_and_restores_none(self) -> None:
        assert Session.before_start(self.num_workers) is None
        session = self.start()
        session.start_epoch(SeedGenerator(7), None)
        it = iter(session.outlet)
        next(it)
        assert session.checkpoint() is None, "DataLoader2 then stores no state: the epoch restarts"
        with self.assertRaisesRegex(ReadingServiceError, "no mid-epoch state to restore"):
            Session.plan(graph(), {"epoch": 0}, self.num_workers, False)
        with self.assertRaisesRegex(ReadingServiceError, "cannot restore"):
            Session.open(graph(), None, plan=object())  # type: ignore[arg-type]

    def test_a_paused_session_snapshots_as_paused_and_resumes(self) -> None:
        session = self.start()
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

    def test_its_epochs_are_torchdatas_for_the_same_seeds(self) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Please use `InProcessReadingService`")
            dl = DataLoader2(graph(), reading_service=TorchdataMPRS(num_workers=0))
        self.addCleanup(dl.shutdown)
        dl.seed(3)
        torchdatas = [list(dl) for _ in range(2)]
        session = self.start()
        generator = SeedGenerator(3)  # what dl.seed(3) gives DataLoader2's generator
        ours = []
        for _ in range(2):
            session.start_epoch(generator, None)
            ours.append(list(session.outlet))
        assert ours == torchdatas and ours[0] != ours[1]


class TestSessionOfTwoWorkers(SessionTests, SuiteTestCase):
    num_workers = 2


if __name__ == "__main__":
    unittest.main()
