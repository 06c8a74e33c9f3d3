"""Self-healing (``restart_dead_workers``): a worker that died is replaced by a new process.

A worker's stream is a deterministic function of its graph and its epoch's seed, so a new
process can be brought to exactly where the dead one was: it is reset to the epoch, replays
(inside itself, from the latest graph state when there is one) the items the main process
already received from the dead one, is paused if the workers are, and gets the credit that was
outstanding. The data is exactly what the dead worker would have sent.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Tuple, Type

from torchdata_snapshot._errors import ProtocolError, WorkerDiedError
from torchdata_snapshot.checkpoint.replay import ReplayProgressLog
from torchdata_snapshot.checkpoint.stream_log import StreamLog, replay_request
from torchdata_snapshot.core.main.worker_record import WorkerRecord
from torchdata_snapshot.core.messages import (
    ErrorResponse,
    GetNextRequest,
    PauseRequest,
    PauseResponse,
    ReplayProgressResponse,
    ReplayResponse,
    Request,
    ResetEpochRequest,
    ResetEpochResponse,
    Response,
)
from torchdata_snapshot.core.transport.channel import Channel

__all__ = ["WorkerReplacer"]

logger = logging.getLogger(__name__)


class WorkerReplacer:
    """Replaces dead workers: ``respawn(worker_id)`` starts a new process and returns its channel;
    each worker may be replaced ``restarts_allowed`` times per epoch."""

    def __init__(
        self, respawn: Callable[[int], Channel], restarts_allowed: int, control_timeout_s: float
    ) -> None:
        self.respawn = respawn
        self.restarts_allowed = restarts_allowed
        self.control_timeout_s = control_timeout_s

    def replace(
        self,
        stream: WorkerRecord,
        death: WorkerDiedError,
        epoch: int,
        reset: ResetEpochRequest,
        paused: bool,
    ) -> None:
        """Give ``stream`` a new worker, reset by ``reset`` (the epoch's request for this worker)
        and brought to the stream's position in ``epoch``; raise ``death``'s error again, saying
        so, once the worker has been replaced too often this epoch."""
        stream.restarts += 1
        if stream.restarts > self.restarts_allowed:
            raise WorkerDiedError(
                f"{death} (it was restarted {self.restarts_allowed} times this epoch already: giving up)"
            ) from death
        if not isinstance(stream.log, StreamLog):
            raise ProtocolError("self-healing needs each worker stream's log (the checkpoint's)") from death
        stream.channel.close()
        started = time.monotonic()
        stream.channel = self.respawn(stream.worker_id)  # (which logs the death at WARNING)
        name = f"restarted {stream.channel.name}"
        steps: List[Tuple[Request, Type[Response]]] = [
            (reset, ResetEpochResponse),
            (replay_request(epoch, stream.log.position(stream.received)), ReplayResponse),
        ]
        if paused:
            steps.append((PauseRequest(), PauseResponse))
        progress, target = ReplayProgressLog(), stream.received
        for request, expected in steps:
            stream.channel.send(request)
            self._await(stream.channel, expected, lambda at: progress.report(name, epoch, at, target))
        outstanding = stream.credit.granted - stream.received
        if outstanding > 0:
            stream.channel.send(GetNextRequest(epoch, outstanding))
        logger.info(
            "%s replaced (pid %s, restart %d of %d this epoch): brought to item %d of epoch %d, where the "
            "dead one was, in %.3f s",
            stream.channel.name,
            stream.channel.pid,
            stream.restarts,
            self.restarts_allowed,
            stream.received,
            epoch,
            time.monotonic() - started,
        )

    def _await(self, channel: Channel, expected: Type[Response], progress: Callable[[int], None]) -> None:
        """Read a new worker's answer to one step (it has no credit yet: it sends nothing else
        but the progress of a long replay, which goes to ``progress``)."""
        while True:
            answer = channel.recv(
                self.control_timeout_s,
                f"{expected.__name__} of a restarted worker",
                option="control_timeout_s",
                while_busy=True,
            )
            if isinstance(answer, ErrorResponse):
                answer.exc.reraise()
            if isinstance(answer, expected):
                return
            if not isinstance(answer, ReplayProgressResponse):
                raise ProtocolError(f"a restarted {channel.name} answered {type(answer).__name__}")
            progress(answer.replayed)
