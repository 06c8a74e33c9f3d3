"""What the package logs: each restore at INFO (how, items replayed, time), a long replay's
progress at INFO (throttled by time), worker replacements and refused checkpoints at WARNING, and
nothing at INFO while an epoch runs. Records come from the package's loggers, under ``torchdata_snapshot``."""

from __future__ import annotations

import logging
import re
import time
import unittest
from functools import partial
from typing import Any, List

import pytest
from conftest import start_methods
from faults import kill_once_at, unseeded_noise
from pipelines import double, rs, take, tiny
from suite_case import LogCapture, SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import FileLister, IterableWrapper

import torchdata_snapshot
from torchdata_snapshot import ChangedFileError, IncompatibleCheckpointError, ReplayDivergenceError
from torchdata_snapshot.checkpoint import outlet as _outlet
from torchdata_snapshot.checkpoint import replay as _replay
from torchdata_snapshot.checkpoint import worker_loop as _replaying
from torchdata_snapshot.checkpoint.format import Checkpoint
from torchdata_snapshot.checkpoint.replay import ReplayProgressLog

PACKAGE = "torchdata_snapshot"


def records(caplog: LogCapture, level: int = logging.INFO) -> List[logging.LogRecord]:
    """The package's records at ``level`` and above."""
    return [
        r
        for r in caplog.records
        if (r.name == PACKAGE or r.name.startswith(PACKAGE + ".")) and r.levelno >= level
    ]


def one(caplog: LogCapture, pattern: str) -> re.Match:
    """The match of ``pattern`` in the one record of the package that has it."""
    found = [m for r in records(caplog, logging.DEBUG) if (m := re.search(pattern, r.getMessage()))]
    assert len(found) == 1, [r.getMessage() for r in records(caplog, logging.DEBUG)]
    return found[0]


#: How long a worker started with ``slow_start`` takes to start (an import of a large library).
SLOW_START_S = 2.0


def slow_start(datapipe: Any, info: Any) -> Any:
    """``worker_init_fn``: a start that takes ``SLOW_START_S`` (a large import, a spawned worker)."""
    time.sleep(SLOW_START_S)
    return datapipe


def restored(make_dl: Any, state: Any, service: Any) -> DataLoader2:
    dl = DataLoader2.from_state(state, service)
    make_dl.created.append(dl)
    return dl


def reading_service_state(state: Any) -> Checkpoint:
    return Checkpoint.from_plain(state["reading_service_state"])


class TestLogging(SuiteTestCase):
    def test_the_package_logger_has_a_null_handler_and_no_level_of_its_own(self) -> None:
        logger = logging.getLogger(PACKAGE)
        assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
        assert logger.level == logging.NOTSET, "the application sets levels"
        assert torchdata_snapshot is not None

    def test_a_replay_restore_logs_how_many_items_it_replayed(self) -> None:
        dl = self.make_dl(tiny(60), rs(2, stateful=False))
        take(iter(dl), 25)
        state = dl.state_dict()
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        dl2 = restored(self.make_dl, state, rs(2, stateful=False))
        assert len(list(dl2)) == 35
        record = next(r for r in records(self.caplog) if "restored epoch" in r.getMessage())
        assert record.name == "torchdata_snapshot.checkpoint.session" and record.levelno == logging.INFO
        m = re.fullmatch(
            r"restored epoch 0 at item 25 \(2 workers\) by replay: (\d+) items replayed, in (\d+\.\d+) s"
            r"( \(after the workers' start, \d+\.\d+ s\))?",
            record.getMessage(),
        )
        assert m is not None, record.getMessage()
        assert int(m[1]) == 25, "each worker replays the items the user had of it"
        assert float(m[2]) < 60

    def test_a_restore_log_says_the_workers_start_apart_from_the_restore(self) -> None:
        dl = self.make_dl(tiny(60), rs(2))
        take(iter(dl), 10)
        state = dl.state_dict()
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        dl2 = restored(self.make_dl, state, rs(2, worker_init_fn=slow_start))
        assert len(list(dl2)) == 50
        m = one(
            self.caplog,
            r"restored epoch 0 at item 10 \(2 workers\) .*, in (\d+\.\d+) s "
            r"\(after the workers' start, (\d+\.\d+) s\)",
        )
        assert float(m[2]) >= SLOW_START_S, "the start is said apart"
        assert float(m[1]) < float(m[2]), "and not counted in the restore"

    def test_a_captured_state_restore_logs_the_few_items_after_the_state(self) -> None:
        dl = self.make_dl(tiny(200), rs(2, max_items_between_captures=4))
        take(iter(dl), 120)
        state = dl.state_dict()
        workers = reading_service_state(state).workers
        assert all(w.state is not None for w in workers)
        expected = sum(w.delivered - w.state[0] for w in workers)  # type: ignore[index]
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        dl2 = restored(self.make_dl, state, rs(2))
        next(iter(dl2))
        m = one(
            self.caplog,
            r"restored epoch 0 at item 120 \(2 workers\) from captured states: (\d+) items replayed",
        )
        assert int(m[1]) == expected < 120

    def test_a_replay_in_the_main_process_is_logged_by_the_outlet(self) -> None:
        dl = self.make_dl(tiny(30), rs(0))
        take(iter(dl), 12)
        state = dl.state_dict()
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        dl2 = restored(self.make_dl, state, rs(0))
        assert len(list(dl2)) == 18
        record = next(r for r in records(self.caplog) if "restored epoch" in r.getMessage())
        assert record.name == "torchdata_snapshot.checkpoint.outlet"
        assert re.fullmatch(
            r"restored epoch 0 at item 12 by replay in the main process: 12 items replayed, in \d+\.\d+ s",
            record.getMessage(),
        ), record.getMessage()

    def test_a_checkpoint_taken_between_epochs_says_the_next_epoch_starts_afresh(self) -> None:
        dl = self.make_dl(tiny(20), rs(2))
        list(dl)
        state = dl.state_dict()
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        assert len(list(restored(self.make_dl, state, rs(2)))) == 20
        one(
            self.caplog,
            r"^restoring a checkpoint taken after epoch 0 ended: epoch 1 starts at its beginning$",
        )

    def test_an_elastic_restore_logs_both_layouts_and_what_it_skips(self) -> None:
        dl = self.make_dl(tiny(60), rs(2))
        take(iter(dl), 20)
        state = dl.state_dict()
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        dl2 = restored(self.make_dl, state, rs(3, elastic=True))
        assert len(list(dl2)) == 40
        one(
            self.caplog,
            r"^restored epoch 0 elastically, from 2 workers x 1 ranks to 3 workers x 1 ranks: "
            r"the 20 elements the user had received whole are skipped",
        )

    def test_steady_state_iteration_logs_nothing_at_info(self) -> None:
        self.caplog.set_level(logging.DEBUG, logger=PACKAGE)
        dl = self.make_dl(tiny(100), rs(2, max_items_between_captures=4))
        for _ in range(2):  # epochs
            for i, _item in enumerate(dl):
                if i % 10 == 0:
                    dl.state_dict()
                    dl.reading_service.snapshot()
        assert records(self.caplog) == [], [r.getMessage() for r in records(self.caplog)]

    @parametrize("context", start_methods("fork"))  # the patched heartbeat reaches fork's workers
    def test_a_long_replay_in_the_workers_logs_its_progress(self, context: str) -> None:
        dl = self.make_dl(tiny(40), rs(1, stateful=False, multiprocessing_context=context))
        take(iter(dl), 30)
        state = dl.state_dict()
        self.monkeypatch.setattr(_replaying, "REPLAY_HEARTBEAT_S", 0.0)  # a progress message after every item
        self.monkeypatch.setattr(_replay, "REPLAY_PROGRESS_LOG_S", 0.0)  # and every one of them logged
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        dl2 = restored(self.make_dl, state, rs(1, stateful=False, multiprocessing_context=context))
        assert len(list(dl2)) == 10
        progress = [r for r in records(self.caplog) if r.name == "torchdata_snapshot.checkpoint.replay"]
        assert progress, "a progress record"
        for record in progress:
            message = record.getMessage()
            m = re.fullmatch(r"worker 0: replaying epoch 0, at item (\d+) of 30 \(\d+ s so far\)", message)
            assert m is not None and 1 <= int(m[1]) <= 30, message

    def test_a_long_replay_in_the_main_process_logs_its_progress(self) -> None:
        dl = self.make_dl(tiny(30), rs(0))
        take(iter(dl), 20)
        state = dl.state_dict()
        self.monkeypatch.setattr(_replay, "REPLAY_PROGRESS_LOG_S", 0.0)
        self.monkeypatch.setattr(_outlet, "PROGRESS_CHECK_ITEMS", 5)
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        list(restored(self.make_dl, state, rs(0)))
        progress = [
            r.getMessage() for r in records(self.caplog) if r.name == "torchdata_snapshot.checkpoint.replay"
        ]
        assert progress == [
            f"main process: replaying epoch 0, at item {i} of 20 ({0:.0f} s so far)" for i in (5, 10, 15, 20)
        ]

    def test_replay_progress_is_throttled_by_time(self) -> None:
        now = [100.0]
        progress = ReplayProgressLog(interval_s=5.0, clock=lambda: now[0])
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        for step in range(1, 41):  # 20 s of a replay, four streams reporting every half second
            now[0] = 100.0 + step / 2
            for worker in range(4):
                progress.report(f"worker {worker}", 3, step * 10, 400)
        messages = [r.getMessage() for r in records(self.caplog)]
        assert messages == [
            "worker 0: replaying epoch 3, at item 100 of 400 (5 s so far)",
            "worker 0: replaying epoch 3, at item 200 of 400 (10 s so far)",
            "worker 0: replaying epoch 3, at item 300 of 400 (15 s so far)",
            "worker 0: replaying epoch 3, at item 400 of 400 (20 s so far)",
        ]
        progress.start()  # the next replay waits its first interval again
        progress.report("worker 1", 4, 1, 2)
        assert len(records(self.caplog)) == 4

    def test_a_replaced_worker_is_logged_at_warning_and_its_replay_at_info(self) -> None:
        marker = self.tmp_path / "kill"
        marker.touch()
        datapipe = IterableWrapper(range(60)).sharding_filter().map(partial(kill_once_at, str(marker), 31))
        self.caplog.set_level(logging.INFO, logger=PACKAGE)
        got = list(self.make_dl(datapipe.map(double), rs(2, restart_dead_workers=2)))
        assert sorted(got) == [2 * x for x in range(60)] and not marker.exists()
        warnings = records(self.caplog, logging.WARNING)
        assert len(warnings) == 1 and warnings[0].name == "torchdata_snapshot.core.main.launcher"
        death = re.fullmatch(
            r"worker 1 \(pid (\d+)\) died \(exit code -9 \(SIGKILL\)\); restarting it and replaying its "
            r"stream to where it stopped \(restart_dead_workers\)",
            warnings[0].getMessage(),
        )
        assert death is not None, warnings[0].getMessage()
        m = one(
            self.caplog,
            r"^worker 1 replaced \(pid (\d+), restart 1 of 2 this epoch\): brought to item (\d+) of epoch 0,",
        )
        assert m[1] != death[1], "a new process"
        assert int(m[2]) <= 15, "worker 1 produces item 31 as its 16th"

    def test_a_refused_checkpoint_is_logged_at_warning_before_any_worker_starts(self) -> None:
        dl = self.make_dl(tiny(40), rs(2))
        take(iter(dl), 10)
        state = dl.state_dict()
        with pytest.raises(IncompatibleCheckpointError):
            list(restored(self.make_dl, state, rs(3)))
        warnings = records(self.caplog, logging.WARNING)
        assert [r.name for r in warnings] == ["torchdata_snapshot.checkpoint.restore_plan"]
        assert (
            warnings[0]
            .getMessage()
            .startswith(
                "the checkpoint was refused: IncompatibleCheckpointError: the checkpoint was taken with "
                "num_workers=2, this reading service has num_workers=3"
            )
        )

    def test_a_refusal_by_load_state_dict_is_logged_at_warning_at_the_call(self) -> None:
        """At the call: another argument, and files that are not the same where the data moved."""
        dl = self.make_dl(tiny(40).batch(4), rs(2))
        take(iter(dl), 3)
        with pytest.raises(IncompatibleCheckpointError):
            torchdata_snapshot.load_state_dict(self.make_dl(tiny(40).batch(8), rs(2)), dl.state_dict())
        (self.tmp_path / "data").mkdir()
        (self.tmp_path / "data" / "a.txt").write_text("".join(f"line {i}\n" for i in range(20)))
        lines = FileLister(str(self.tmp_path / "data")).sharding_filter().open_files().readlines()
        dl = self.make_dl(lines, rs(2, max_items_between_captures=1))
        take(iter(dl), 5)
        state = dl.state_dict()
        (self.tmp_path / "moved").mkdir()  # the data moved, its file did not
        moved = FileLister(str(self.tmp_path / "moved")).sharding_filter().open_files().readlines()
        with pytest.raises(ChangedFileError):
            torchdata_snapshot.load_state_dict(self.make_dl(moved, rs(2)), state)
        warnings = [(r.name, r.getMessage()) for r in records(self.caplog, logging.WARNING)]
        assert [name for name, _ in warnings] == ["torchdata_snapshot.checkpoint.restore_plan"] * 2
        assert warnings[0][1].startswith("the checkpoint was refused: IncompatibleCheckpointError: ")
        assert "batch_size was 4 in the checkpoint, is 8 now" in warnings[0][1]
        assert warnings[1][1].startswith("the checkpoint was refused: ChangedFileError: the data moved")

    @parametrize("num_workers", [0, 2])
    def test_a_replay_that_diverges_is_logged_at_warning(self, num_workers: int) -> None:
        datapipe = IterableWrapper(range(40)).sharding_filter().map(unseeded_noise)
        dl = self.make_dl(datapipe, rs(num_workers, stateful=False))
        take(iter(dl), 10)
        state = dl.state_dict()
        with pytest.raises(ReplayDivergenceError):
            list(restored(self.make_dl, state, rs(num_workers, stateful=False)))
        warnings = records(self.caplog, logging.WARNING)
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert warnings[0].name == "torchdata_snapshot.checkpoint.restore_plan"  # (where refusals are logged)
        message = warnings[0].getMessage()
        assert message.startswith(
            "the checkpoint was refused while epoch 0 was restored: ReplayDivergenceError: "
        )


instantiate_parametrized_tests(TestLogging)


if __name__ == "__main__":
    unittest.main()
