"""The autouse guard of conftest.py fails a test that leaves a child process running, or a
shared-memory entry of its own processes (not another program's) behind."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

_LEAKY_TEST = """
import multiprocessing, time

def test_leaks_a_process():
    multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True).start()
"""


def test_the_guard_fails_a_test_that_leaves_a_process(pytester: pytest.Pytester, monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCHDATA_SNAPSHOT_LEFTOVER_WAIT_S", "1")
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=textwrap.dedent(_LEAKY_TEST))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--rootdir={pytester.path}")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the test left child processes running: pid *"])


#: Another program, as far as the test's process tree can tell: its first child exits at once, so
#: that the second (which makes a ``spawn`` lock: a named semaphore in /dev/shm while it lives) is
#: nobody's child in the tree. It writes the semaphore's path to its ``ready`` pipe, then waits
#: until the test closes its ``control`` pipe (at most a minute); the test sees it exit when
#: ``ready`` reaches its end.
_ANOTHER_PROGRAM = """
import multiprocessing, os, select, sys
ready, control = int(sys.argv[1]), int(sys.argv[2])
if os.fork():
    os._exit(0)
lock = multiprocessing.get_context("spawn").Lock()
os.write(ready, ("/dev/shm/sem." + lock._semlock.name.lstrip("/")).encode())
select.select([control], [], [], 60)
"""

_SHARED_MEMORY_TESTS = """
import os, select, subprocess, sys
from multiprocessing import shared_memory

import pytest

WAIT_S = 30

ANOTHER_PROGRAM = {another_program!r}


def wait_readable(fd):
    assert select.select([fd], [], [], WAIT_S)[0], "the other program did not answer"


@pytest.fixture(scope="module")
def leftovers():
    # Module-scoped: removed after the guard (a function-scoped fixture) has looked at them.
    segments, programs = [], []
    yield segments, programs
    for segment in segments:
        segment.close()
        segment.unlink()
    for ready, control in programs:
        os.close(control)
        wait_readable(ready)
        assert os.read(ready, 1) == b"", "the other program is gone: its semaphore with it"
        os.close(ready)


@pytest.fixture
def another_program(leftovers):
    def start():
        ready_r, ready_w = os.pipe()
        control_r, control_w = os.pipe()
        first = subprocess.Popen(
            [sys.executable, "-c", ANOTHER_PROGRAM, str(ready_w), str(control_r)],
            pass_fds=(ready_w, control_r),
            start_new_session=True,
        )
        os.close(ready_w)
        os.close(control_r)
        leftovers[1].append((ready_r, control_w))
        assert first.wait(timeout=WAIT_S) == 0
        wait_readable(ready_r)
        path = os.read(ready_r, 4096).decode()
        assert os.path.exists(path), path
        return path

    return start


def test_another_program_makes_a_semaphore(another_program):
    another_program()


def test_leaves_a_segment_it_maps(leftovers, another_program):
    another_program()
    leftovers[0].append(shared_memory.SharedMemory(create=True, size=4096))


def test_leaves_a_segment_nobody_holds(leftovers):
    segment = shared_memory.SharedMemory(create=True, size=4096)
    segment.close()
    leftovers[0].append(segment)
"""


def test_the_guard_counts_only_the_shared_memory_of_the_tests_processes(pytester: pytest.Pytester) -> None:
    """Another program's semaphores that appear during a test are not the test's; a segment the
    test's process still maps, or that nobody holds any more, is."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_shm=_SHARED_MEMORY_TESTS.format(another_program=_ANOTHER_PROGRAM))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--rootdir={pytester.path}")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaves_a_segment_it_maps*",
            "*the test left shared-memory segments in /dev/shm: [[]'psm_*'[]]",  # only it
            "*ERROR at teardown of test_leaves_a_segment_nobody_holds*",
            "*the test left shared-memory segments in /dev/shm: [[]'psm_*'[]]",  # only it
        ]
    )
    result.stdout.no_fnmatch_line("*sem.mp-*")


_LEAKY_POOL_TEST = """
import builtins
from torchdata_snapshot.core.options import TensorPoolOptions
from torchdata_snapshot.tensor_pool.pool import TensorPool

def test_keeps_a_tensor_pool_mapped():
    builtins.kept = TensorPool(TensorPoolOptions(1, 4096))
"""


def test_the_guard_fails_a_test_that_leaves_a_tensor_pool_mapped(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=textwrap.dedent(_LEAKY_POOL_TEST))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--rootdir={pytester.path}")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the test left 1 tensor pool(s) mapped in the main process*"])
