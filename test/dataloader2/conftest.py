"""The suite's guard, which fails any test leaving a child process alive, a shared-memory segment
of its processes behind, or a tensor pool mapped in this process; and the start methods of this
platform, with the skips of what needs one it lacks. (What a test uses, loaders shut down after
it included, is helpers/suite_case.py's SuiteTestCase.)"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from typing import Any, Dict, Iterable, List, Set, Tuple

import psutil
import pytest

#: The start methods of this platform (Windows has no fork, nor forkserver).
START_METHODS = multiprocessing.get_all_start_methods()


def start_methods(*names: str) -> List[str]:
    """Those of ``names`` this platform has: a test parametrized over them has no case for the
    others (Windows has no fork, nor forkserver)."""
    return [name for name in names if name in START_METHODS]


#: Modules that start processes with fork when they are imported.
collect_ignore = [] if "fork" in START_METHODS else ["test_channel.py", "test_leak_guard.py"]

#: A test that forks (a script that runs without a main guard, a child forked as a checkpoint
#: writer is): skipped where there is no fork (Windows).
requires_fork = pytest.mark.skipif(
    "fork" not in START_METHODS, reason=f"no fork start method on {sys.platform}"
)


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """A test parametrized with a start method this platform lacks is skipped, saying why."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        context = callspec.params.get("context") if callspec is not None else None
        if isinstance(context, str) and context not in START_METHODS:
            item.add_marker(pytest.mark.skip(reason=f"no {context!r} start method on {sys.platform}"))


#: Long-lived helpers that multiprocessing itself starts and keeps: not leaks.
_MULTIPROCESSING_HELPERS = ("forkserver", "resource_tracker")

#: How long a test's leftover child processes get to exit before the test fails.
LEFTOVER_WAIT_S = float(os.environ.get("TORCHDATA_SNAPSHOT_LEFTOVER_WAIT_S", "15"))


def _children() -> Dict[int, psutil.Process]:
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            if child.status() == psutil.STATUS_ZOMBIE or any(h in command for h in _MULTIPROCESSING_HELPERS):
                continue
        except psutil.Error:
            continue
        out[child.pid] = child
    return out


_SHM = "/dev/shm/"


def _shared_memory() -> Set[str]:
    return set(os.listdir(_SHM)) if os.path.isdir(_SHM) else set()


#: A file by identity: ``(st_dev, st_ino)``.
_FileId = Tuple[int, int]


def _held_shared_memory(pid: int) -> Set[_FileId]:
    """The /dev/shm files process ``pid`` maps (``/proc/<pid>/maps``: a named semaphore, a mapped
    segment) or has open (``/proc/<pid>/fd``); nothing if it is gone or not ours to read.

    Files, not names: glibc's ``sem_open`` maps a temporary file and then links it under the
    semaphore's name, so that the mapping shows the temporary name, ``(deleted)``.
    """
    held = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if _SHM in line:  # address perms offset major:minor inode path
                    device, inode = line.split()[3:5]
                    major, minor = (int(part, 16) for part in device.split(":"))
                    held.add((os.makedev(major, minor), int(inode)))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(_SHM):
                    found = os.stat(f"/proc/{pid}/fd/{fd}")
                    held.add((found.st_dev, found.st_ino))
            except OSError:  # closed meanwhile
                continue
    except OSError:  # the process is gone, or belongs to another user
        pass
    return held


def _ours(new: Iterable[str]) -> List[str]:
    """The entries of ``new`` (entries that appeared in /dev/shm during the test) that this
    test's processes left behind: those this process or a descendant still holds, and those no
    process holds any more. Other programs use /dev/shm at the same time (another Python's
    ``spawn`` locks are named semaphores, ``sem.mp-*``, as long as they live): an entry that
    only processes outside this process's tree hold is theirs, as are entries that are already
    gone again or belong to another user. /proc is read only when there are new entries: a test
    that leaves none costs nothing more than listing /dev/shm."""
    candidates = _existing(new)
    if not candidates:
        return []
    tree = {os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))}
    held_by_tree = set().union(*map(_held_shared_memory, tree))
    unexplained = set(candidates) - held_by_tree
    for pid in psutil.pids():
        if not unexplained:
            break
        if pid not in tree:
            unexplained -= _held_shared_memory(pid)
    # Another program may have let go of an entry while we looked: gone now, it was not left.
    unexplained &= set(_existing(candidates[file] for file in unexplained))
    return sorted(name for file, name in candidates.items() if file in held_by_tree or file in unexplained)


def _existing(names: Iterable[str]) -> Dict[_FileId, str]:
    """The entries of /dev/shm among ``names`` that exist and belong to this user, by file."""
    found: Dict[_FileId, str] = {}
    for name in names:
        try:
            stat = os.stat(_SHM + name)
        except FileNotFoundError:
            continue
        if stat.st_uid == os.getuid():
            found[(stat.st_dev, stat.st_ino)] = name
    return found


#: How a tensor pool's memfd shows in ``/proc/self/maps`` (see ``torchdata_snapshot.tensor_pool.pool``).
_POOL_MAPPING = "/memfd:torchdata_snapshot tensor pool"


def _mapped_pools() -> int:
    """How many tensor pools this process maps: they are unmapped once no tensor views them.
    None where there is no /proc (macOS, Windows): no memfd there either, so no pool."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(_POOL_MAPPING in line for line in maps)
    except FileNotFoundError:
        return 0


@pytest.fixture(autouse=True)
def no_leftover_processes_or_shared_memory(request: pytest.FixtureRequest) -> Any:
    """Fail the test if it leaves a child process running or a /dev/shm segment behind (one its
    processes still hold, or that nobody holds: see :func:`_ours`).

    Leftovers get ``LEFTOVER_WAIT_S`` to exit (a bounded wait, not a sleep), then are killed
    so that the next test starts clean, and the test fails naming them.
    """
    before, shm_before, pools_before = _children(), _shared_memory(), _mapped_pools()
    yield
    if _mapped_pools() > pools_before:
        gc.collect()  # the test's own tensors, in a frame or a cycle: then gone
    pools_left = _mapped_pools() - pools_before
    leftover = [child for pid, child in _children().items() if pid not in before]
    _, alive = psutil.wait_procs(leftover, timeout=LEFTOVER_WAIT_S)
    described = []
    for child in alive:
        try:
            described.append(f"pid {child.pid} ({' '.join(child.cmdline())[:80]})")
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=LEFTOVER_WAIT_S)
    assert not described, f"the test left child processes running: {', '.join(described)}"
    left = _ours(_shared_memory() - shm_before)
    assert not left, f"the test left shared-memory segments in /dev/shm: {left}"
    assert pools_left <= 0, f"the test left {pools_left} tensor pool(s) mapped in the main process"
