"""One request/response pipe pair between two processes, with bounded waits and liveness checks.

DataLoader2 moves messages through ``multiprocessing.Queue`` objects and waits for them
by sleep-polling. Here each direction is one end of an OS pipe (``multiprocessing.Pipe(duplex=False)``):

* waits block in ``poll(timeout)`` (``select``), never in a sleep loop; the timeout only
  exists so that the waiter can check that the other side is still alive;
* once the parent closes the child's ends, a dead child shows up at once as ``EOFError``
  on the parent's read end, and a dead parent as ``EOFError`` on the child's;
* there is no feeder thread: ``send`` pickles and writes in the caller's thread, so the order
  of messages on a pipe is the order of the ``send`` calls, across data and control messages.

Two ends exist: :class:`Channel` is held by the side that sends requests (the main process
towards a worker, or a worker towards the dispatching process), :class:`Endpoint` by the side
that serves them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, List, Optional, Sequence, Tuple

from torchdata_snapshot._constants import (
    BUSY_CPU_FRACTION,
    EXIT_CODE_WAIT_S,
    LIVENESS_CHECK_INTERVAL_S,
    STARTUP_TIMEOUT_S,
)
from torchdata_snapshot._errors import WorkerDiedError, WorkerTimeoutError
from torchdata_snapshot.core.transport.item_codec import ItemPool

__all__ = [
    "Channel",
    "Endpoint",
    "ParentGone",
    "ParentWatch",
    "describe_exit",
    "make_pipe_pair",
    "process_exit",
]


class ParentGone(Exception):
    """Raised inside a child process when its parent has exited: the child should exit too."""


def describe_exit(exitcode: Optional[int]) -> str:
    """Human words for a process exit code: ``exit code -9 (SIGKILL)``."""
    if exitcode is None:
        return "no exit code yet"
    if exitcode < 0:
        try:
            return f"exit code {exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"exit code {exitcode}"
    return f"exit code {exitcode}"


def process_exit(process: BaseProcess, wait_s: float = 0.0) -> Tuple[bool, Optional[int]]:
    """``(exited, exit code)`` of ``process`` after waiting up to ``wait_s`` for it. A process the
    reading service closed at shutdown (releasing its handles) has exited, code unknown."""
    try:
        if wait_s:
            process.join(wait_s)
        code = process.exitcode
    except ValueError:  # closed: it was joined before
        return True, None
    return code is not None, code


def make_pipe_pair(ctx: Any = None) -> Tuple[Channel, Endpoint, Tuple[Connection, Connection]]:
    """Create the two pipes of one channel.

    Returns ``(channel, endpoint, child_ends)``; after handing ``endpoint`` to a child process,
    the parent must close ``child_ends`` so that the child's death is seen as end-of-file.
    With ``ctx=None`` plain ``multiprocessing.Pipe`` is used (in-process tests).
    """
    pipe = (ctx or multiprocessing).Pipe
    request_reader, request_writer = pipe(duplex=False)
    response_reader, response_writer = pipe(duplex=False)
    channel = Channel(request_writer, response_reader)
    endpoint = Endpoint(request_reader, response_writer)
    return channel, endpoint, (request_reader, response_writer)


def _close_quietly(*conns: Connection) -> None:
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass


def cpu_seconds(pid: Optional[int]) -> Optional[float]:
    """The CPU time (user and system) process ``pid`` has used so far, or ``None`` where it cannot
    be read (no ``/proc`` and no psutil: waits are then bounded as if the process were idle)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    except Exception:  # psutil missing, or the process gone
        return None


class Channel:
    """The requesting side of a pipe pair: ``send`` requests, ``recv`` responses.

    ``name`` names the serving process in errors ("worker 2", "dispatching process").
    ``process`` is that process, when this side owns it: its death is then reported with pid
    and exit code. ``watch`` is called on every liveness check and may raise to abort the
    wait, for example when another process the serving side depends on has died.
    """

    def __init__(self, request_conn: Connection, response_conn: Connection) -> None:
        self.request_conn = request_conn
        self.response_conn = response_conn
        self.name = "peer"
        self.process: Optional[BaseProcess] = None
        self.watch: Optional[Callable[[], None]] = None
        self.pool: Optional[ItemPool] = None  # the serving worker's tensor pool, if it has one
        self._pid: Optional[int] = None
        self._answered = False  # see STARTUP_TIMEOUT_S

    def bind(
        self,
        name: str,
        process: Optional[BaseProcess] = None,
        watch: Optional[Callable[[], None]] = None,
        pid: Optional[int] = None,
    ) -> Channel:
        """Name the serving side for errors; ``process`` (if owned) or ``pid`` identify it."""
        self.name, self.process, self.watch = name, process, watch
        self._pid = process.pid if process is not None else pid
        return self

    def fileno(self) -> int:
        """The response end, so that channels can be waited on with ``multiprocessing.connection.wait``."""
        return self.response_conn.fileno()

    def send(self, request: Any) -> None:
        try:
            self.request_conn.send(request)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            self._raise_dead(e)

    def poll(self) -> bool:
        """Whether a response can be read without blocking."""
        try:
            return self.response_conn.poll()
        except (EOFError, OSError):
            return True  # `recv` will report the death

    def recv(
        self,
        timeout_s: Optional[float] = None,
        what: str = "a response",
        option: Optional[str] = None,
        while_busy: bool = False,
    ) -> Any:
        """Block until the next response, checking liveness every ``LIVENESS_CHECK_INTERVAL_S``.

        Raises :class:`WorkerDiedError` if the serving process exits, :class:`WorkerTimeoutError`
        if ``timeout_s`` passes first (``None`` waits as long as the process lives; the first
        answer gets at least ``STARTUP_TIMEOUT_S``); its message names ``option``, the setting
        that bounds this wait. ``while_busy``: the bound is on a process that is stuck, not on
        one that is slow: a process that used at least ``BUSY_CPU_FRACTION`` of the bound in CPU
        time (a reset function, a graph's start, on a loaded machine) gets another ``timeout_s``.
        """
        if timeout_s is not None and not self._answered:
            timeout_s = max(timeout_s, STARTUP_TIMEOUT_S)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        cpu_s = cpu_seconds(self._pid) if while_busy and deadline is not None else None
        while True:
            wait_s = LIVENESS_CHECK_INTERVAL_S
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
            try:
                if self.response_conn.poll(wait_s):
                    response = self.response_conn.recv()
                    self._answered = True
                    return response
            except (EOFError, ConnectionResetError, OSError) as e:
                self._raise_dead(e)
            self.check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                assert timeout_s is not None
                used_s = None if cpu_s is None else cpu_seconds(self._pid)
                if (
                    cpu_s is not None
                    and used_s is not None
                    and used_s - cpu_s >= BUSY_CPU_FRACTION * timeout_s
                ):
                    cpu_s, deadline = used_s, time.monotonic() + timeout_s  # slow, not stuck
                    continue
                idle = " and used no CPU time" if cpu_s is not None and used_s is not None else ""
                setting = "" if option is None else f" (raise {option}, in seconds, if it needs longer)"
                raise WorkerTimeoutError(
                    f"{self.name} did not send {what} within {timeout_s:.1f} s{idle}; it is alive "
                    f"(pid {self.pid}) but stuck{setting}"
                )

    @property
    def pid(self) -> Optional[int]:
        return self._pid

    def check_alive(self) -> None:
        """Raise :class:`WorkerDiedError` if the serving process (or what ``watch`` covers) died."""
        if self.process is not None and process_exit(self.process)[0]:
            self._raise_dead(None)
        if self.watch is not None:
            self.watch()

    def raise_if_dead(self, cause: BaseException) -> None:
        """Raise :class:`WorkerDiedError` from ``cause`` (an error reading what the serving
        process sent) if that process died; return if it is alive."""
        if self.process is not None and process_exit(self.process, EXIT_CODE_WAIT_S)[0]:
            self._raise_dead(cause)

    def _raise_dead(self, cause: Optional[BaseException]) -> None:
        exited, exitcode = False, None
        if self.process is not None:
            exited, exitcode = process_exit(self.process, EXIT_CODE_WAIT_S)
        if self.watch is not None and not exited:
            self.watch()  # the real culprit may be another process
        raise WorkerDiedError(
            f"{self.name} (pid {self.pid}) exited unexpectedly with {describe_exit(exitcode)}"
        ) from cause

    def close(self) -> None:
        _close_quietly(self.request_conn, self.response_conn)
        self.pool = None  # unmapped once the main process drops its last view of it


class ParentWatch:
    """Tells, inside a child process, whether the process that started it is still alive.

    With ``fork`` and ``spawn`` that process is the child's parent: once it dies the child is
    adopted and ``os.getppid()`` changes. A ``forkserver`` child's parent is the fork server,
    which outlives the training process; there the child watches the sentinel multiprocessing
    gives it instead (a pipe the starting process holds open: end-of-file once it is gone).
    The start method is told apart once, at start-up, by who the parent is.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._sentinel: Optional[int] = None
        if os.getppid() != pid:
            parent = multiprocessing.parent_process()
            if parent is not None and parent.pid == pid:
                self._sentinel = parent.sentinel

    def alive(self) -> bool:
        if self._sentinel is not None:
            return not multiprocessing.connection.wait([self._sentinel], timeout=0)
        return os.getppid() == self.pid


class Endpoint:
    """The serving side of a pipe pair: ``recv`` requests, ``send`` responses.

    ``parent`` (a :class:`ParentWatch`) is checked whenever a wait times out: if the process
    that started this one is gone (a killed training job), :class:`ParentGone` is raised and the
    loop exits instead of lingering.
    """

    def __init__(self, request_conn: Connection, response_conn: Connection) -> None:
        self.request_conn = request_conn
        self.response_conn = response_conn
        self.parent: Optional[ParentWatch] = None

    def fileno(self) -> int:
        return self.request_conn.fileno()

    def poll(self) -> bool:
        try:
            return self.request_conn.poll()
        except (EOFError, OSError) as e:
            raise ParentGone from e

    def recv(self, timeout_s: Optional[float] = LIVENESS_CHECK_INTERVAL_S) -> Any:
        """The next request, or ``None`` if none came within ``timeout_s``."""
        try:
            if self.request_conn.poll(timeout_s):
                return self.request_conn.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            raise ParentGone from e
        self.check_parent()
        return None

    def check_parent(self) -> None:
        if self.parent is not None and not self.parent.alive():
            raise ParentGone

    def send(self, response: Any) -> None:
        try:
            self.response_conn.send(response)
        except (BrokenPipeError, ConnectionResetError, EOFError) as e:
            raise ParentGone from e

    def close(self) -> None:
        _close_quietly(self.request_conn, self.response_conn)


def wait_any(channels: Sequence[Any], timeout_s: Optional[float]) -> List[Any]:
    """The channels (or endpoints) among ``channels`` that have a message ready."""
    return list(multiprocessing.connection.wait(list(channels), timeout_s))
