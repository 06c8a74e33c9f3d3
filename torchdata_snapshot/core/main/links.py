"""``WorkerLinks``: how the main process reads from and talks to its workers.

Every exchange goes through here, under one lock: reading a worker's stream (data and graph
states are kept in its :class:`~torchdata_snapshot.core.main.worker_record.WorkerRecord`, control answers
are returned), sending a request, and asking every worker at once and collecting every answer.
Every wait is bounded; an exchange that does not complete leaves the links ``broken`` (a message
may be lost, so nothing is read any more) and the reading service shuts down. A worker found dead
during an epoch (from its reset on) is replaced when self-healing allows it
(:class:`~torchdata_snapshot.core.main.links.Replacer`).
See NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Protocol, Sequence, Type, TypeVar, cast

from torchdata_snapshot._constants import NO_EPOCH
from torchdata_snapshot._errors import (
    ProtocolError,
    ReadingServiceClosedError,
    ReadingServiceError,
    WorkerDiedError,
    WorkerError,
)
from torchdata_snapshot.core.main.positions import UserPositions
from torchdata_snapshot.core.main.worker_record import WorkerRecord
from torchdata_snapshot.core.messages import (
    ErrorResponse,
    GetNextRequest,
    ReplayProgressResponse,
    ReplayRequest,
    Request,
    ResetEpochRequest,
    ResetEpochResponse,
    Response,
    TerminateRequest,
    TerminateResponse,
)
from torchdata_snapshot.core.plugins import ProgressLog
from torchdata_snapshot.core.transport.channel import Channel

__all__ = ["REPLACED", "Replacer", "ReplacerFactory", "SilentProgress", "WorkerLinks"]

R = TypeVar("R", bound=Response)

#: Returned by :meth:`WorkerLinks.read` when the worker was found dead and replaced: read again.
REPLACED: Any = object()


class Replacer(Protocol):
    """Self-healing (an optional feature, ``replacer`` in :mod:`torchdata_snapshot.core.plugins`):
    gives a worker that died a new process, brought to where the dead one was."""

    def replace(
        self,
        stream: WorkerRecord,
        death: WorkerDiedError,
        epoch: int,
        reset: ResetEpochRequest,
        paused: bool,
    ) -> None: ...


#: ``(respawn, restarts_allowed, control_timeout_s) -> Replacer``; ``respawn(worker_id)`` starts a
#: new process for a worker and returns its channel.
ReplacerFactory = Callable[[Callable[[int], Channel], int, float], Replacer]


class SilentProgress:
    """A :class:`~torchdata_snapshot.core.plugins.ProgressLog` that says nothing."""

    def start(self) -> None:
        pass

    def report(self, where: str, epoch: int, position: int, target: int) -> None:
        pass


class WorkerLinks:
    """The main process's side of every worker's channel, for the epoch ``epoch``."""

    def __init__(
        self,
        streams: Sequence[WorkerRecord],
        control_timeout_s: float,
        data_timeout_s: Optional[float],
        positions: Optional[UserPositions],
        replacer: Optional[Replacer],
    ) -> None:
        self.streams = list(streams)
        self.control_timeout_s = control_timeout_s
        self.data_timeout_s = data_timeout_s
        self.positions = positions
        self.replacer = replacer
        self.lock = threading.RLock()
        self.epoch = NO_EPOCH
        self.paused = False
        self.closed = False
        # Set when an operation was interrupted between a request and its answer, or a message
        # was lost: the pipes can no longer be trusted, and nothing may be read from them.
        self.broken: Optional[str] = None
        # The epoch's streams are set up (its reset has begun): a dead worker may be replaced.
        self.in_epoch = False
        self.reset_requests: Sequence[ResetEpochRequest] = ()  # the epoch's, one per worker
        # The progress of long replays (the checkpoint's log, started by each restore's replay).
        self.progress: ProgressLog = SilentProgress()

    def check_open(self) -> None:
        if self.closed:
            raise ReadingServiceClosedError("the reading service was shut down; its workers are gone")
        self.check_not_broken()

    def check_not_broken(self) -> None:
        if self.broken is not None:
            raise ReadingServiceError(
                f"the reading service cannot continue after an interrupted exchange with its workers "
                f"({self.broken}): a message may be lost. Shut it down and restore the last checkpoint."
            )

    # --- one worker -----------------------------------------------------------------------------

    def read(
        self,
        stream: WorkerRecord,
        timeout_s: Optional[float],
        what: str,
        option: str = "timeout_s",
        while_busy: bool = False,
    ) -> Any:
        """Read one message of ``stream``: data and states are kept in it (``None`` is returned),
        a control answer is returned, and :data:`REPLACED` if the worker was found dead and replaced.

        A read that does not complete (the worker died, the wait timed out, Ctrl-C) leaves the
        links ``broken``; once they are closed, a dead worker means "shut down". ``option``, the
        setting ``timeout_s`` comes from, and ``while_busy``: see :meth:`Channel.recv`.
        """
        try:
            response = stream.channel.recv(timeout_s, what, option, while_busy)
            filed = stream.file(response, self.epoch)
        except WorkerError as e:
            if self.closed:
                raise ReadingServiceClosedError(
                    f"the reading service was shut down while waiting for {what} from {stream.channel.name}"
                ) from e
            if isinstance(e, WorkerDiedError) and self._may_replace():
                self._replace(stream, e)
                return REPLACED
            self.broken = f"{type(e).__name__}: {e}"
            raise
        except BaseException as e:
            self.broken = f"{type(e).__name__} while waiting for {what}"
            raise
        if not filed:
            return response
        # Digests and states behind what may still be asked for are dropped: the user's position
        # when it is known (checkpoints), else what was received (self-healing only needs that).
        stream.prune(
            stream.received if self.positions is None else self.positions.delivered[stream.worker_id]
        )
        return None

    def send(self, stream: WorkerRecord, request: Request, heal: bool) -> Optional[Response]:
        """Send ``request``; a worker found dead is replaced first if ``heal`` allows it, and the
        request redone (:meth:`_redo`). ``None``, or the answer when the replacement gave it."""
        try:
            stream.channel.send(request)
            return None
        except WorkerDiedError as e:
            if not (heal and self._may_replace()):
                self.broken = f"{type(e).__name__}: {e}"
                raise
            self._replace(stream, e)
            return self._redo(stream, request)

    def _redo(self, stream: WorkerRecord, request: Request) -> Optional[Response]:
        """``request`` to a worker just replaced, which was reset to the epoch, replayed to the
        stream's position, paused if the workers are and given all outstanding credit: an epoch
        reset is done (its answer is returned), credit is not sent again, anything else (a
        replay, a snapshot, pause, resume, limit) is sent again."""
        if isinstance(request, ResetEpochRequest):
            return ResetEpochResponse(request.epoch)
        if isinstance(request, GetNextRequest):
            return None
        return self.send(stream, request, heal=True)

    def await_answer(self, stream: WorkerRecord, expected: Type[R], request: Request) -> Response:
        """Read ``stream`` up to its answer of type ``expected`` (or an ``ErrorResponse``). Items
        read on the way are kept: they precede the answer in the worker's stream."""
        while True:
            response = self.read(
                stream, self.control_timeout_s, expected.__name__, "control_timeout_s", while_busy=True
            )
            if response is REPLACED:
                answer = self._redo(stream, request)
                if answer is not None:
                    return answer
            elif isinstance(response, ReplayProgressResponse):
                if isinstance(request, ReplayRequest):  # a long replay that is alive: wait on
                    target = request.skip + (0 if request.state is None else request.state[0])
                    name, at = stream.channel.name, response.replayed
                    self.progress.report(name, response.epoch, at, target)
            elif response is None:
                continue  # data on the way
            elif isinstance(response, (expected, ErrorResponse)):
                return response
            else:
                self.broken = f"unexpected {type(response).__name__}"
                raise ProtocolError(
                    f"{stream.channel.name} answered {type(response).__name__} while "
                    f"{expected.__name__} was expected"
                )

    # --- every worker ---------------------------------------------------------------------------

    def request_all(self, make_request: Callable[[int], Request], expected: Type[R]) -> List[R]:
        """Send one request to every worker, then collect every answer (in parallel, not in turn).

        All answers are read before an error answer is raised, so that no answer is left in a
        pipe; anything else that interrupts the exchange leaves the links ``broken``.
        """
        with self.lock:
            self.check_open()
            try:
                requests = [make_request(stream.worker_id) for stream in self.streams]
                given = [
                    self.send(stream, request, heal=True) for stream, request in zip(self.streams, requests)
                ]
                answers = [
                    self.await_answer(stream, expected, request) if answer is None else answer
                    for stream, request, answer in zip(self.streams, requests, given)
                ]
            except BaseException as e:
                if self.broken is None:
                    self.broken = f"{type(e).__name__} during {expected.__name__}"
                raise
            for answer in answers:
                if isinstance(answer, ErrorResponse):
                    answer.exc.reraise()
            return cast(List[R], answers)  # (the error answers were raised above)

    def terminate(self, timeout_s: float) -> bool:
        """Ask every worker to stop and read up to its goodbye, within ``timeout_s`` in total (a
        stuck worker costs that once, not once per worker); items still in flight are read and
        dropped, which releases the tensors they hold (the consumer's ``close`` drops those it
        had buffered). Whether every worker said goodbye."""
        asked = []
        for stream in self.streams:
            try:
                stream.channel.send(TerminateRequest())
                asked.append(stream)
            except Exception:
                pass  # dead already: the caller kills and joins what is left
        deadline = time.monotonic() + timeout_s
        said_goodbye = 0
        for stream in asked:
            try:
                while not isinstance(
                    self.read(stream, max(0.0, deadline - time.monotonic()), "TerminateResponse"),
                    TerminateResponse,
                ):
                    pass
                said_goodbye += 1
            except Exception:
                pass
        return said_goodbye == len(self.streams)

    # --- self-healing ---------------------------------------------------------------------------

    def _may_replace(self) -> bool:
        return self.replacer is not None and self.in_epoch and not self.closed

    def _replace(self, stream: WorkerRecord, death: WorkerDiedError) -> None:
        assert self.replacer is not None
        try:
            self.replacer.replace(
                stream, death, self.epoch, self.reset_requests[stream.worker_id], self.paused
            )
        except BaseException as e:
            self.broken = f"restarting worker {stream.worker_id} failed: {type(e).__name__}: {e}"
            raise
