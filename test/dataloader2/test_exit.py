"""A training process always ends, with its workers, however its script leaves the training loop.

Every test here runs a script as users run theirs, in a subprocess of its own: it iterates a
2-worker DataLoader2, prints the pids of every process it started, then leaves without calling
``DataLoader2.shutdown()`` (the tests of the rest of the suite always call it). The process must
exit within ``EXIT_LIMIT_S`` of leaving, with the expected exit code, and every process it
started must be gone with it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import unittest
from typing import List

import psutil
import pytest
from conftest import requires_fork, start_methods
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot import MultiProcessingReadingService

#: How long a script may take to exit once it leaves its training loop. DataLoader2's reading
#: service takes about 2 s; a process that hangs never exits at all.
EXIT_LIMIT_S = 15.0

#: How long the script may take to start its workers and print their pids (spawn imports torch).
START_LIMIT_S = 120.0

SCRIPT = """
import gc, signal, sys, warnings
warnings.simplefilter("ignore")
import psutil
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from {module} import MultiProcessingReadingService

LOADERS = []


def double(x):
    return 2 * x


def fails_at_20(x):
    if x == 20:
        raise ValueError("a map function failed in a worker")
    return x


def make(context, fn=double):
    dp = IterableWrapper(range(10**6)).shuffle(buffer_size=100).sharding_filter().map(fn)
    rs = MultiProcessingReadingService(num_workers=2, multiprocessing_context=context)
    dl = DataLoader2(dp, reading_service=rs)
    dl.seed(0)
    return dl


def started_processes():
    return psutil.Process().children(recursive=True)


def workers_of(started):
    # started, less the helpers multiprocessing keeps for this process's lifetime (the resource
    # tracker, the fork server): the workers (with forkserver, the fork server's children)
    helpers = [p.pid for p in psutil.Process().children() if "multiprocessing" in " ".join(p.cmdline())]
    return [p for p in started if p.pid not in helpers]


def leave(how, context):
    dl = make(context, fails_at_20 if how == "worker_error" else double)
    for step, _ in enumerate(dl):
        if step == 10:
            started = started_processes()
            print("started", *[p.pid for p in started], flush=True)
            if how == "end":
                LOADERS.append(dl)  # a loader kept in a global: the script simply ends
                return
            if how == "raise":
                raise RuntimeError("a training step failed")
            if how == "exit":
                sys.exit(3)
            if how == "keyboard_interrupt":
                raise KeyboardInterrupt
            if how == "cycle":
                holder = {{"dl": dl}}
                holder["self"] = holder  # garbage that only the collector, disabled here, frees
                return
            if how == "dropped":
                return started  # the loader is dropped with this frame
        # "sigint" keeps iterating until the test interrupts the process group; "worker_error"
        # gets the worker's exception at its 20th element


if __name__ == "__main__":
    # Ctrl-C as in a terminal's foreground job, even under a runner started in the background
    # (a non-interactive shell starts background jobs with SIGINT ignored, and so their children)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    how, context = sys.argv[1], sys.argv[2]
    gc.disable()
    started = leave(how, context)
    if how == "dropped":
        # the script goes on with other work: the workers of the loader it dropped end now
        _, alive = psutil.wait_procs(workers_of(started), timeout={limit})
        print("alive after drop", *[p.pid for p in alive], flush=True)
"""

#: How each way of leaving ends the process: its exit code.
LEAVING = {
    "end": 0,
    "dropped": 0,
    "cycle": 0,
    "raise": 1,
    "worker_error": 1,
    "exit": 3,
    "keyboard_interrupt": -signal.SIGINT,
    "sigint": -signal.SIGINT,
}


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line the script prints, waiting at most ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"the script printed nothing within {timeout_s} s"
    return proc.stdout.readline()


def _kill_all(proc: subprocess.Popen, pids: List[int]) -> None:
    """Whatever the outcome, nothing the test started outlives it."""
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(EXIT_LIMIT_S)


def _leave_and_check_the_exit(proc: subprocess.Popen, how: str, context: str) -> None:
    pids: List[int] = []
    try:
        line = _read_line(proc, START_LIMIT_S)
        assert line.startswith("started"), line
        pids = [int(pid) for pid in line.split()[1:]]
        assert len(pids) >= 2, f"the script should have started its workers: {line}"
        left = time.monotonic()
        if how == "sigint":
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        try:
            stdout, stderr = proc.communicate(timeout=EXIT_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script ({how}, {context}) did not exit within {EXIT_LIMIT_S} s of leaving")
        took = time.monotonic() - left
        assert proc.returncode == LEAVING[how], stderr
        _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)
        assert not alive, f"processes of the script outlived it: {[p.pid for p in alive]}"
        if how == "dropped":
            assert stdout.split() == ["alive", "after", "drop"], "workers outlived their loader"
        if how in ("keyboard_interrupt", "sigint"):
            # the training process's own KeyboardInterrupt, not a worker's nor a dead worker
            assert stderr.count("Traceback") == 1, stderr
            assert stderr.rstrip().endswith("KeyboardInterrupt") and "WorkerDiedError" not in stderr, stderr
        if how == "worker_error":
            assert "a map function failed in a worker" in stderr, stderr
        assert took < EXIT_LIMIT_S
    finally:
        _kill_all(proc, pids)


FORKING_SCRIPT = """
import os, sys, warnings
warnings.simplefilter("ignore")
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from {module} import MultiProcessingReadingService

if __name__ == "__main__":
    rs = MultiProcessingReadingService(num_workers=2, multiprocessing_context="fork")
    dl = DataLoader2(IterableWrapper(range(200)).sharding_filter(), reading_service=rs)
    it = iter(dl)
    got = [next(it) for _ in range(10)]
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a child of the training process ends normally: its exit hooks run
    _, status = os.waitpid(child, 0)
    got += list(it)
    dl.shutdown()
    print(os.waitstatus_to_exitcode(status), sorted(got) == list(range(200)))
"""


class TestExit(SuiteTestCase):
    @pytest.mark.slow
    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    @parametrize("how", sorted(LEAVING))
    def test_a_script_that_leaves_without_shutdown_ends_with_its_workers(
        self, how: str, context: str
    ) -> None:
        script = self.tmp_path / "train.py"
        script.write_text(SCRIPT.format(module=MultiProcessingReadingService.__module__, limit=EXIT_LIMIT_S))
        with subprocess.Popen(
            [sys.executable, str(script), how, context],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as a job started from a shell
        ) as proc:
            _leave_and_check_the_exit(proc, how, context)

    @requires_fork
    def test_a_forked_child_that_exits_leaves_the_parents_workers_alone(self) -> None:
        """A process forked from the training process (``os.fork``) inherits its exit hooks; when it
        exits, the hook must not stop the workers of its parent's loader."""
        script = self.tmp_path / "fork_and_exit.py"
        script.write_text(FORKING_SCRIPT.format(module=MultiProcessingReadingService.__module__))
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=START_LIMIT_S
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["0", "True"], done.stderr


instantiate_parametrized_tests(TestExit)


if __name__ == "__main__":
    unittest.main()
