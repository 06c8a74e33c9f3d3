"""The exceptions the reading service raises, in one place.

The hierarchy is small on purpose, so that a training loop can tell apart the two
questions that matter on a bad day: "did a process fail?" and "does this checkpoint fit?"

::

    ReadingServiceError (RuntimeError)
    ├── WorkerError                      a worker or the dispatching process failed
    │   ├── WorkerDiedError              ... exited (killed, crashed); names worker, pid, exit code
    │   └── WorkerTimeoutError           ... is alive but did not answer within the bound
    ├── ProtocolError                    a message nobody expected (a request the loop does not know)
    ├── ReadingServiceClosedError        the reading service was used after ``shutdown()``
    └── CheckpointError                  a checkpoint cannot be taken or used
        ├── StateCaptureError            a DataPipe's state could not be taken or pickled
        ├── StateRestoreError            a DataPipe's ``load_state_dict`` failed
        │   └── ChangedFileError         a file being read, or a directory being listed, changed
        ├── InvalidCheckpointError       truncated, corrupted or of another format version
        ├── IncompatibleCheckpointError  valid, but for another ``num_workers`` or pipeline
        └── ReplayDivergenceError        replay did not reproduce the recorded items

Errors raised by the user's own DataPipes inside a worker are re-raised in the main process
with their original type and the worker's traceback, as DataLoader2 does; they are
not wrapped in these classes.

Each class has an entry in docs/troubleshooting.rst (what causes it, what to do), whose anchor is
the class's name in lower case; every message ends by naming it:
``... (troubleshooting: docs/troubleshooting.rst#workerdiederror)``.

``ExceptionWrapper`` carries an exception raised in a worker (or a thread) to the main process.
"""

from __future__ import annotations

import sys
from typing import Any

from torchdata._utils import ExceptionWrapper as _TorchdataExceptionWrapper

__all__ = [
    "ChangedFileError",
    "CheckpointError",
    "IncompatibleCheckpointError",
    "InvalidCheckpointError",
    "ProtocolError",
    "ReadingServiceClosedError",
    "ReadingServiceError",
    "ReplayDivergenceError",
    "StateCaptureError",
    "StateRestoreError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerTimeoutError",
]


#: The page with an entry for each of these exceptions.
TROUBLESHOOTING = "docs/troubleshooting.rst"


class ReadingServiceError(RuntimeError):
    """Base class of every exception the reading service raises itself.

    ``str()`` of one ends with the entry of docs/troubleshooting.rst about its class (once: a
    message that quotes another error of the same class, or an error re-raised from a worker
    with its traceback, already names it).
    """

    def __str__(self) -> str:
        message = super().__str__()
        entry = f"{TROUBLESHOOTING}#{type(self).__name__.lower()}"
        return message if entry in message else f"{message} (troubleshooting: {entry})"


class WorkerError(ReadingServiceError):
    """A worker process or the dispatching process failed; the reading service was shut down."""


class WorkerDiedError(WorkerError):
    """A worker or the dispatching process exited while the main process depended on it.

    The message names the process (``worker 2``, ``dispatching process``), its pid and its exit
    code (negative for a signal, e.g. ``-9`` for SIGKILL).
    """


class WorkerTimeoutError(WorkerError):
    """A process stayed alive but did not answer a control request within the time bound."""


class ProtocolError(ReadingServiceError):
    """A process received a message it does not handle, or an answer that does not fit the request."""


class ReadingServiceClosedError(ReadingServiceError):
    """The reading service was used (``snapshot()``, ``checkpoint()``, ...) after ``finalize()``."""


class CheckpointError(ReadingServiceError):
    """A checkpoint could not be taken, or a state could not be restored."""


class StateCaptureError(CheckpointError):
    """Taking the state of a DataPipe failed: its ``state_dict()`` raised, or the state is not picklable.

    The message names the DataPipe (and, when known, the attribute that could not be pickled).
    """


class StateRestoreError(CheckpointError):
    """Loading a state into a DataPipe failed (its ``load_state_dict()`` raised)."""


class ChangedFileError(StateRestoreError):
    """A file the restore reads again (one a captured state was reading, or one opened between
    that state and the user's position) is gone, or its size or modification time changed:
    resuming in it would hand out other records. Or a directory a ``FileLister`` was listing no
    longer lists first the files it had handed on: resuming would skip or repeat files. The
    message names the file or the directory."""


class InvalidCheckpointError(CheckpointError, ValueError):
    """The reading-service state is not a valid checkpoint of this format and version.

    Raised for truncated or corrupted states, states written by another format version, and
    anything that is not the plain data ``checkpoint()`` produces. Nothing is started.
    """


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint is valid but was taken with another ``num_workers`` or another pipeline.

    Prefetch counts and the multiprocessing context may differ between save and restore (they do
    not change the order of the data); the number of workers and the pipeline's structure may not.
    """


class ReplayDivergenceError(CheckpointError):
    """Deterministic replay produced different items than the run that was checkpointed.

    The pipeline is not deterministic for the given seed: the message names the usual causes
    (``hash()`` of strings without a fixed ``PYTHONHASHSEED``, an unseeded source of randomness, a
    file that changed). Continuing would silently hand out other data. ``verify_replay=False``
    turns the check off, and with it this protection: a restore then accepts whatever the
    pipeline produces now.
    """


# --- errors raised in another process -----------------------------------------------------------


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process (or thread): the cause of the
    exception re-raised from it in this one."""


class ExceptionWrapper(_TorchdataExceptionWrapper):
    """``torchdata._utils.ExceptionWrapper``: an exception raised in a worker (or a thread), which
    its ``reraise()`` raises in the main process. An exception of the user's pipeline is re-raised
    as torchdata does (its type, its message ``Caught ValueError in worker process 1.`` followed by
    the worker's traceback). One of this package's (a :class:`ReadingServiceError`, such as
    ``ChangedFileError``: its message says what happened and what to do) is re-raised with that
    message only, the worker's traceback as its cause (``raise ... from``), so that the last
    line a user reads is the message, not the worker's frames."""

    def __init__(self, exc_info: Any = None, where: str = "in background") -> None:
        exc_info = sys.exc_info() if exc_info is None else exc_info
        super().__init__(exc_info, where)
        exception = exc_info[1]
        self.message = _own_message(exception) if isinstance(exception, ReadingServiceError) else None

    def reraise(self) -> None:
        message = getattr(self, "message", None)  # (None: an exception of the user's)
        if message is None:
            super().reraise()
        cause = RemoteTraceback(f"{self.exc_type.__name__} {self.where}:\n{self.exc_msg}")
        raise self.exc_type(message) from cause


#: What torch's iterator hook appends to the message of an exception raised in a DataPipe's
#: ``__iter__``, naming it (``This exception is thrown by __iter__ of MapperIterDataPipe(...)``).
_HOOK_NOTE = "\nThis exception is thrown by "


def _own_message(exception: BaseException) -> str:
    """``exception``'s message as it was raised, without the notes torch's hook appended."""
    return str(exception).split(_HOOK_NOTE, 1)[0]
