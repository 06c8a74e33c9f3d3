"""The suite's TestCase: what its tests use besides the DataPipes (pytest's fixtures, as a class).

``self.make_dl(datapipe, reading_service, seed=0)`` makes a seeded ``DataLoader2`` that is shut
down after the test (as is one made otherwise once added to ``self.make_dl.created``);
``self.tmp_path`` is a directory of the test's own, removed after it; ``self.monkeypatch``
undoes its patches after the test; ``self.caplog`` holds the records logged during the test
(``records``; ``set_level(level, logger=name)`` for the test).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, List, Optional

import expecttest
import pytest
from torchdata.dataloader2 import DataLoader2


class LoaderMaker:
    """``make_dl``: seeded loaders, each shut down by :meth:`shutdown_all`."""

    def __init__(self) -> None:
        self.created: List[Any] = []

    def __call__(self, datapipe: Any, reading_service: Any, seed: Any = 0) -> DataLoader2:
        dl = DataLoader2(datapipe, reading_service=reading_service)
        if seed is not None:
            dl.seed(seed)
        self.created.append(dl)
        return dl

    def shutdown_all(self) -> None:
        for dl in self.created:
            dl.shutdown()


class LogCapture(logging.Handler):
    """The records logged while it is installed (on the root logger), and levels set for a while."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: List[logging.LogRecord] = []
        self._levels: List[Any] = []  # (logger, its level before)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def set_level(self, level: int, logger: Optional[str] = None) -> None:
        target = logging.getLogger(logger)
        self._levels.append((target, target.level))
        target.setLevel(level)

    def restore(self) -> None:
        logging.getLogger().removeHandler(self)
        for target, level in reversed(self._levels):
            target.setLevel(level)


class SuiteTestCase(expecttest.TestCase):
    """A test of the suite: loaders shut down, a temporary directory and patches undone after it;
    ``assertExpectedInline`` (expecttest) where an exact message is the contract."""

    def setUp(self) -> None:
        super().setUp()
        self.make_dl = LoaderMaker()
        self.addCleanup(self.make_dl.shutdown_all)
        self.monkeypatch = pytest.MonkeyPatch()
        self.addCleanup(self.monkeypatch.undo)
        self._tmp_path: Optional[Path] = None
        self.caplog = LogCapture()
        logging.getLogger().addHandler(self.caplog)
        self.addCleanup(self.caplog.restore)

    @property
    def tmp_path(self) -> Path:
        if self._tmp_path is None:
            self._tmp_path = Path(tempfile.mkdtemp(prefix="suite_case_"))
            self.addCleanup(shutil.rmtree, self._tmp_path, ignore_errors=True)
        return self._tmp_path

    @classmethod
    def class_directory(cls, prefix: str) -> Path:
        """A directory for the whole class (what its ``setUpClass`` builds), removed after it."""
        directory = Path(tempfile.mkdtemp(prefix=prefix))
        cls.addClassCleanup(shutil.rmtree, directory, ignore_errors=True)
        return directory


class ResumingTestCase(SuiteTestCase):
    """A TestCase whose tests resume in fresh processes: one ``contract.Resumer`` for the class
    (imported here, not by contract.py, whose fresh processes need no test framework)."""

    resumer: Any

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        from contract import Resumer

        cls.resumer = Resumer()
        cls.addClassCleanup(cls.resumer.close)
