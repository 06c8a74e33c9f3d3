"""Shared fixtures: DataLoader2s that are always shut down, and a guard that fails any test
leaving a child process alive or a shared-memory segment behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Set

import psutil
import pytest
from torchdata.dataloader2 import DataLoader2

sys.path.insert(0, str(Path(__file__).parent))  # `import pipelines` in tests and in spawned workers


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


def _shared_memory() -> Set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(autouse=True)
def no_leftover_processes_or_shared_memory(request: pytest.FixtureRequest) -> Any:
    """Fail the test if it leaves a child process running or a /dev/shm segment behind.

    Leftovers get ``LEFTOVER_WAIT_S`` to exit (a bounded wait, not a sleep), then are killed
    so that the next test starts clean, and the test fails naming them.
    """
    before, shm_before = _children(), _shared_memory()
    yield
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
    new_segments = sorted(_shared_memory() - shm_before)
    assert not new_segments, f"the test left shared-memory segments in /dev/shm: {new_segments}"


@pytest.fixture
def make_dl() -> Any:
    """``make_dl(datapipe, reading_service, seed=0)``: a seeded DataLoader2, shut down after the test."""
    created: List[DataLoader2] = []

    def make(datapipe: Any, reading_service: Any, seed: Any = 0) -> DataLoader2:
        dl = DataLoader2(datapipe, reading_service=reading_service)
        if seed is not None:
            dl.seed(seed)
        created.append(dl)
        return dl

    yield make
    for dl in created:
        dl.shutdown()


Maker = Callable[..., DataLoader2]
