"""Faults (docs/troubleshooting.rst): every fault ends in a clear exception within a bounded time,
leaves no orphan process (the autouse guard of conftest.py checks that after every test) and
never returns wrong data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import unittest
import weakref
from typing import Any, Dict, Iterator, List

import psutil
import pytest
import torch
from conftest import start_methods
from faults import BlockOnStateDict, FailingStateDict, KillOnStateDict, UnpicklableState, killing
from pipelines import megabyte, pipeline, rs, take
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot import (
    ReadingServiceClosedError,
    ReadingServiceError,
    StateCaptureError,
    WorkerDiedError,
)
from torchdata_snapshot.core.main.consumer import WorkerConsumer
from torchdata_snapshot.core.transport.channel import make_pipe_pair

BOUND_S = 30.0  # generous: every fault must surface well within this


def reference_of(datapipe: Any, make_dl: Any) -> List[Any]:
    return list(make_dl(datapipe, rs(2)))


_ORPHAN_SCRIPT = """
import os, signal, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = {path!r}
from pipelines import pipeline, rs
from torchdata.dataloader2 import DataLoader2
dl = DataLoader2(pipeline("dispatch", 10000), reading_service=rs(2, multiprocessing_context={context!r}))
it = iter(dl)
next(it)
pids = [s.pid for s in dl.reading_service.snapshot()]
print(" ".join(map(str, pids)), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def python_ctrl_c() -> Iterator[None]:
    """Python's own Ctrl-C handler, even under a test runner started with SIGINT ignored (a
    background job of a non-interactive shell)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def processes_left() -> List[Any]:
    """Child processes, but for the helpers multiprocessing itself keeps (fork server, resource
    tracker)."""
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if not any(helper in " ".join(child.cmdline()) for helper in ("forkserver", "resource_tracker")):
                left.append(child)
        except psutil.Error:
            pass
    return left


class TestFaults(SuiteTestCase):
    def test_a_worker_killed_mid_iteration(self) -> None:
        reference = reference_of(killing(self.tmp_path / "absent", 41), self.make_dl)
        marker = self.tmp_path / "kill"
        marker.touch()
        dl = self.make_dl(killing(marker, 41), rs(2))
        got = []
        start = time.monotonic()
        with pytest.raises(
            WorkerDiedError, match=r"worker 1 \(pid \d+\) exited unexpectedly with exit code -9 \(SIGKILL\)"
        ):
            for x in dl:
                got.append(x)
        assert time.monotonic() - start < BOUND_S
        assert got == reference[: len(got)], "what was delivered before the death is exactly right"
        assert not marker.exists(), "the worker really died at item 41"

    def test_a_worker_killed_during_snapshot(self) -> None:
        dl = self.make_dl(KillOnStateDict(IterableWrapper(range(50))).sharding_filter(), rs(2))
        take(iter(dl), 3)
        start = time.monotonic()
        with pytest.raises(
            WorkerDiedError, match=r"worker [01] \(pid \d+\) exited unexpectedly with exit code -9"
        ):
            dl.reading_service.snapshot()
        assert time.monotonic() - start < BOUND_S
        with pytest.raises(ReadingServiceClosedError):
            dl.reading_service.snapshot()  # the service shut itself down: nothing is left running

    def test_the_dispatching_process_killed(self) -> None:
        dl = self.make_dl(pipeline("dispatch", 5000), rs(2))
        it = iter(dl)
        take(it, 5)
        dispatcher = dl.reading_service.snapshot()[-1]
        assert dispatcher.role == "dispatcher"
        os.kill(dispatcher.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            WorkerDiedError, match=rf"dispatching process \(pid {dispatcher.pid}\) exited unexpectedly"
        ):
            list(it)
        assert time.monotonic() - start < BOUND_S

    @parametrize("shape", ["global_rng", "dispatch"])
    def test_sigterm_to_every_process_leaves_the_workers_running(self, shape: str) -> None:
        """Preemption (SLURM's) sends SIGTERM to every process of the job; the training process
        finishes its step and checkpoints, which needs its workers: they ignore SIGTERM."""
        reference = list(self.make_dl(pipeline(shape, 200), rs(2)))
        dl = self.make_dl(pipeline(shape, 200), rs(2))
        it = iter(dl)
        got = take(it, 20)
        pids = [s.pid for s in dl.reading_service.snapshot()]
        assert len(pids) == (3 if shape == "dispatch" else 2)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        assert [s.pid for s in dl.reading_service.snapshot()] == pids, "every process answers"
        assert got + list(it) == reference

    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    def test_a_killed_training_process_leaves_no_orphans(self, context: str) -> None:
        # With forkserver the workers' parent is the fork server, which outlives the training process.
        script = _ORPHAN_SCRIPT.format(path=sys.path, context=context)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == -signal.SIGKILL, done.stderr
        pids = [int(p) for p in done.stdout.split()]
        assert len(pids) == 3, "two workers and the dispatching process"
        processes = []
        for pid in pids:
            try:
                processes.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(processes, timeout=BOUND_S)
        for process in alive:
            process.kill()
        assert not alive, "workers must notice that their parent is gone and exit"

    def test_a_failing_state_dict_names_the_datapipe_and_the_service_goes_on(self) -> None:
        reference = list(self.make_dl(FailingStateDict(IterableWrapper(range(30))).sharding_filter(), rs(2)))
        dl = self.make_dl(FailingStateDict(IterableWrapper(range(30))).sharding_filter(), rs(2))
        it = iter(dl)
        head = take(it, 4)
        with pytest.raises(
            StateCaptureError, match=r"state_dict\(\) of DataPipe \d+:FailingStateDict .* OSError: the index"
        ):
            dl.reading_service.snapshot()
        assert head + list(it) == reference, "every answer was read: the data goes on exactly"

    def test_an_unpicklable_state_names_the_datapipe_and_the_attribute(self) -> None:
        dl = self.make_dl(UnpicklableState(IterableWrapper(range(30))).sharding_filter(), rs(2))
        take(iter(dl), 4)
        with pytest.raises(
            StateCaptureError,
            match=r"DataPipe \d+:UnpicklableState .* cannot be pickled \(attribute 'lock'\)",
        ):
            dl.reading_service.snapshot()

    @pytest.mark.usefixtures("python_ctrl_c")
    def test_ctrl_c_during_a_snapshot_shuts_the_service_down(self) -> None:
        fifo = self.tmp_path / "fifo"
        os.mkfifo(fifo)
        dl = self.make_dl(BlockOnStateDict(IterableWrapper(range(30)), str(fifo)).sharding_filter(), rs(2))
        it = iter(dl)
        take(it, 2)

        def ctrl_c_mid_snapshot() -> None:
            with open(fifo, "rb") as f:  # returns once a worker is inside state_dict()
                f.read()
            # To the main thread itself: a process-wide SIGINT may be taken by another thread and
            # seen by the main thread only when it next runs Python code.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

        interrupter = threading.Thread(target=ctrl_c_mid_snapshot, daemon=True)
        interrupter.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            dl.reading_service.snapshot()
        assert time.monotonic() - start < BOUND_S
        interrupter.join(BOUND_S)
        with pytest.raises(ReadingServiceClosedError):
            dl.reading_service.snapshot()
        with pytest.raises(ReadingServiceError, match="cannot continue after an interrupted exchange"):
            next(it)  # never a silent StopIteration: a message may have been lost

    def test_shutdown_from_another_thread_during_a_snapshot(self) -> None:
        fifo = self.tmp_path / "fifo"
        os.mkfifo(fifo)
        dl = self.make_dl(BlockOnStateDict(IterableWrapper(range(30)), str(fifo)).sharding_filter(), rs(2))
        take(iter(dl), 2)
        outcome: List[BaseException] = []

        def snapshot() -> None:
            try:
                dl.reading_service.snapshot()
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=snapshot)
        thread.start()
        with open(fifo, "rb") as f:  # returns once a worker is inside state_dict(), mid-snapshot
            assert f.read()
        start = time.monotonic()
        dl.shutdown()
        thread.join(BOUND_S)
        assert not thread.is_alive() and time.monotonic() - start < BOUND_S
        assert len(outcome) == 1 and isinstance(outcome[0], ReadingServiceClosedError), outcome
        assert "shut down while waiting for GetStateResponse" in str(outcome[0])

    def test_an_interrupted_read_never_continues_silently(self) -> None:
        from torchdata_snapshot.core.main.consumer import WorkerConsumer

        consumer = WorkerConsumer([], window=1)
        consumer.links.broken = "KeyboardInterrupt while waiting for an item"
        with pytest.raises(ReadingServiceError, match="cannot continue after an interrupted exchange"):
            consumer.next_item(consumer.epoch)

    def test_shutdown_releases_everything_at_once_over_many_loaders(self) -> None:
        """Pipes, process handles, threads, shared memory: back to where they were after every
        shutdown, although every loader stays referenced (a job keeping one loader per validation
        run)."""
        import gc

        gc.collect()
        fds, threads = open_fds(), threading.active_count()
        kept = []
        shapes = ["shuffle_before_sharding", "dispatch", "stateful_source", "non_replicable_tail"]
        shapes += ["tensors", "tensors_by_default"]
        for cycle in range(50):
            shape = shapes[cycle % len(shapes)]
            options: Dict[str, Any] = {}
            if shape.startswith("tensors"):  # shared memory, or by default the tensor pool's memfds
                dp = IterableWrapper(range(60)).sharding_filter().map(megabyte)
                options["tensor_pool"] = None if shape == "tensors_by_default" else False
            else:
                dp = pipeline(shape, 60)
            dl = DataLoader2(dp, reading_service=rs(2, restart_dead_workers=0, **options))
            it = iter(dl)
            take(it, 5)
            dl.state_dict()
            dl.shutdown()
            kept.append((dl, it))
            assert open_fds() == fds, f"cycle {cycle}: {open_fds() - fds} file descriptors still open"
            assert threading.active_count() == threads, f"cycle {cycle}: a thread outlived shutdown"
            assert not processes_left(), f"cycle {cycle}: a process outlived shutdown"

    def test_shutdown_after_a_death_drops_the_items_buffered_from_the_workers(self) -> None:
        # No goodbye is read after a death: close() still drops what the main process had buffered.
        channel, _, child_ends = make_pipe_pair()
        consumer = WorkerConsumer([channel.bind("worker 0")], window=1)
        consumer.streams[0].buffer.append(torch.ones(4))
        released = weakref.ref(consumer.streams[0].buffer[0])
        for end in child_ends:
            end.close()  # the worker's ends: it is dead
        with pytest.raises(WorkerDiedError, match="worker 0"):
            consumer.links.read(consumer.streams[0], timeout_s=10, what="an item")
        assert not consumer.request_terminate(timeout_s=10)  # the links are broken
        consumer.close()
        assert released() is None and not consumer.streams[0].buffer


instantiate_parametrized_tests(TestFaults)


if __name__ == "__main__":
    unittest.main()
