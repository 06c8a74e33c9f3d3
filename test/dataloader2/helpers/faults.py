"""DataPipes and functions that fail on purpose, for the tests of faults: workers killed or stuck
at an item, failing or unpicklable states, pipelines that replay other items than they gave."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import re
import signal
import time
from typing import Any, Dict, Iterator, List

from pipelines import double
from torch.utils.data import IterDataPipe
from torchdata.datapipes.iter import IterableWrapper


def unseeded_noise(x: int) -> tuple:
    """Not reproducible by any seed: a pipeline using it cannot be replayed."""
    return (x, random.SystemRandom().randint(0, 10**9))


def stuck_at_5(x: int) -> int:
    """Never returns for item 5: a worker stuck in user code (blocks, does not sleep-poll)."""
    if x == 5:
        import threading

        threading.Event().wait()
    return x


_RESETS = [0]


def busy_on_second_reset(datapipe: Any, worker_info: Any, seed_generator: Any) -> Any:
    """``worker_reset_fn``: the worker's second epoch reset computes for 3 s (a slow start, not a
    stuck one)."""
    _RESETS[0] += 1
    if _RESETS[0] == 2:
        end = time.process_time() + 3.0
        while time.process_time() < end:
            pass
    return datapipe


def stuck_at_5_telling(fifo: str, x: int) -> int:
    """:func:`stuck_at_5` that first writes a byte to the named pipe ``fifo``: the test then knows
    the worker is inside item 5 (see :func:`wait_for_fifo`)."""
    if x == 5:
        with open(fifo, "wb") as entered:
            entered.write(b"5")
    return stuck_at_5(x)


def wait_for_fifo(fifo: str, timeout_s: float) -> bool:
    """Whether a byte arrived on the named pipe ``fifo`` within ``timeout_s`` (a bounded wait)."""
    import select

    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
            if ready and os.read(fd, 1):
                return True
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def restarts_logged(match: str = "restarting it") -> Iterator[List[str]]:
    """The messages of the worker restarts (self-healing) the package logs at WARNING inside the
    block that match ``match``; none is an ``AssertionError`` (as ``pytest.warns`` has it)."""
    messages: List[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and re.search(match, record.getMessage()):
                messages.append(record.getMessage())

    handler, logger = Collect(), logging.getLogger("torchdata_snapshot")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
    assert messages, f"no worker restart matching {match!r} was logged"


def kill_once_at(marker: str, k: int, x: int) -> int:
    """SIGKILL the process producing item ``k`` if ``marker`` exists (and remove it: once only)."""
    if x == k and os.path.exists(marker):
        os.unlink(marker)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def killing(marker: Any, k: int, n: int = 100) -> Any:
    """``n`` items, sharded, doubled; the worker producing item ``k`` is killed if ``marker``
    (a path) exists then (see :func:`kill_once_at`)."""
    return (
        IterableWrapper(range(n))
        .sharding_filter()
        .map(functools.partial(kill_once_at, str(marker), k))
        .map(double)
    )


class Passthrough(IterDataPipe):
    def __init__(self, source: IterDataPipe) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        yield from self.source


class KillOnStateDict(Passthrough):
    """Its worker dies (SIGKILL) while answering a snapshot."""

    def state_dict(self) -> Dict[str, Any]:
        os.kill(os.getpid(), signal.SIGKILL)
        return {}


class FailingStateDict(Passthrough):
    def state_dict(self) -> Dict[str, Any]:
        raise OSError("the index file is gone")


class UnpicklableState(Passthrough):
    def state_dict(self) -> Dict[str, Any]:
        import threading

        return {"position": 3, "lock": threading.Lock()}


class BlockOnStateDict(Passthrough):
    """Announces through the FIFO ``fifo`` that a snapshot reached it, then hangs."""

    def __init__(self, source: IterDataPipe, fifo: str) -> None:
        super().__init__(source)
        self.fifo = fifo

    def state_dict(self) -> Dict[str, Any]:
        import threading

        with open(self.fifo, "wb") as f:
            f.write(b"in state_dict")
        threading.Event().wait()
        return {}


def kill_always_at(k: int, x: int) -> int:
    """SIGKILL the process producing item ``k``, every time: a worker that cannot be healed."""
    if x == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


class ChangesOnceMarked(IterDataPipe):
    """``range(n)``, except that once the file ``marker`` exists its first item is ``-1``: a
    pipeline that replays differently after the checkpoint (a data file that changed)."""

    def __init__(self, n: int, marker: str) -> None:
        self.n = n
        self.marker = marker

    def __iter__(self) -> Iterator[int]:
        changed = os.path.exists(self.marker)
        for x in range(self.n):
            yield -1 if changed and x == 0 else x


class SystemRandomOrder(IterDataPipe):
    """``range(n)`` in an order no seed reproduces (``random.SystemRandom``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        random.SystemRandom().shuffle(order)
        yield from order


class OffByOneState(IterDataPipe):
    """``range(n)`` with state methods that are deliberately wrong: a loaded state resumes one
    item too late (a broken adapter)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0
        self._loaded: Any = None

    def __iter__(self) -> Iterator[int]:
        self.position, self._loaded = (self._loaded or 0), None
        while self.position < self.n:
            self.position += 1
            yield self.position - 1

    def state_dict(self) -> Dict[str, int]:
        return {"position": self.position + 1}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self._loaded = state["position"]


def kill_once_at_reset(marker: str, datapipe: Any, worker_info: Any, seed_generator: Any) -> Any:
    """A ``worker_reset_fn`` that SIGKILLs the worker resetting to an epoch if ``marker``
    exists (and removes it: once only, the worker that removed it): a worker that dies in the
    middle of an epoch reset."""
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return datapipe
    os.kill(os.getpid(), signal.SIGKILL)
    return datapipe
