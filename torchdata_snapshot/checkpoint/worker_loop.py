"""``ReplayingWorkerLoop``: the worker loop that can also be restored by replay.

It extends the core's streaming loop (:class:`~torchdata_snapshot.core.worker.loop.WorkerLoop`)
with what a checkpoint needs of a worker: each item carries the stream's running digest
(:mod:`torchdata_snapshot.checkpoint.digest`) and the elements the graph's sharding filter had taken
when it was yielded, and ``ReplayRequest`` produces and drops the items the user received before
the checkpoint, checked against the digest the checkpoint recorded (:func:`replay`). Loading a
captured state first is :class:`~torchdata_snapshot.graph_state.worker_loop.StatefulWorkerLoop`'s.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from torchdata_snapshot._constants import REPLAY_HEARTBEAT_S
from torchdata_snapshot._errors import ProtocolError, ReplayDivergenceError
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain
from torchdata_snapshot.checkpoint.replay import own_stateful, replay
from torchdata_snapshot.core.messages import (
    ReplayProgressResponse,
    ReplayRequest,
    ReplayResponse,
    ResetEpochRequest,
)
from torchdata_snapshot.core.transport.batches import QueuedItem
from torchdata_snapshot.core.worker.epoch import WorkerEpoch
from torchdata_snapshot.core.worker.loop import WorkerLoop

__all__ = ["ReplayingWorkerLoop"]


class ReplayingWorkerLoop(WorkerLoop):
    """A :class:`WorkerLoop` whose items carry their stream's running digest and sharding
    position, and which serves ``ReplayRequest``."""

    def _start_epoch(self, request: ResetEpochRequest, epoch: WorkerEpoch) -> None:
        super()._start_epoch(request, epoch)
        epoch.digest = CHAIN_START if self.options.restore.verify_replay else None

    def _queued(self, epoch: WorkerEpoch, item: Any, payload: bytes) -> QueuedItem:
        if epoch.digest is not None:
            epoch.digest = chain(epoch.digest, item)
        return QueuedItem(
            epoch.number, payload, epoch.digest, self.encoder.shared, epoch.taken(), slot=self.encoder.slot
        )

    # --- restore --------------------------------------------------------------------------------

    def _on_replay(self, request: ReplayRequest) -> None:
        epoch = self.current
        if request.epoch != epoch.number or epoch.produced or epoch.iterator is None:
            raise ProtocolError(
                f"{self.name}: a replay must directly follow the reset of epoch {request.epoch}"
            )
        start = self._replay_start(request, epoch)
        self._replay(epoch, start, request.skip, request.digest)
        self._replayed(epoch)
        self.outbox.start_epoch(epoch.number, sent=epoch.produced)  # as if those had been sent
        self.outbox.put(ReplayResponse(epoch.number, request.skip))

    def _replay_start(self, request: ReplayRequest, epoch: WorkerEpoch) -> int:
        """The item the replay starts after: 0, the epoch's beginning (loading the captured state
        a request may bring is the stateful loop's)."""
        if request.state is not None:
            raise ProtocolError(f"{self.name} cannot load a captured state: it restores by replay only")
        return 0

    def _replayed(self, epoch: WorkerEpoch) -> None:
        """After a replay, before streaming goes on from where it ended."""

    def _replay(self, epoch: WorkerEpoch, start: int, skip: int, expected: Optional[str]) -> None:
        """Produce and drop items ``start + 1 .. start + skip``: the rest of what the user received
        before the checkpoint, after the state loaded at ``start`` (0: the epoch's beginning).
        They never leave this process; their running digest must end as ``expected``."""
        heartbeat = time.monotonic() + REPLAY_HEARTBEAT_S

        def progress(position: int) -> None:  # a long replay tells the main process it is alive
            nonlocal heartbeat
            if time.monotonic() >= heartbeat:
                self.outbox.put(ReplayProgressResponse(epoch.number, position))
                heartbeat = time.monotonic() + REPLAY_HEARTBEAT_S

        assert epoch.iterator is not None
        try:
            epoch.digest = replay(
                epoch.iterator, start, skip, epoch.digest, expected, where=self.name, epoch=epoch.number,
                on_item=progress, stateful=own_stateful(dp for _, dp in self._graph),
            )  # fmt: skip
        except ReplayDivergenceError:
            epoch.iterator = None
            raise
        epoch.produced = start + skip


ReplayingWorkerLoop.HANDLERS = {**WorkerLoop.HANDLERS, ReplayRequest: "_on_replay"}
