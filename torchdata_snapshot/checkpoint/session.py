"""``CheckpointSession``: the core's session, extended to checkpoint and restore by replay.

It records what a checkpoint needs at each epoch's start (the generator's state, before the
epoch's seeds are drawn) and takes checkpoints of what the *user* received
(:class:`~torchdata_snapshot.checkpoint.format.Checkpoint`); a restore is planned before any
process starts (:meth:`CheckpointSession.plan`, with
:func:`~torchdata_snapshot.checkpoint.restore_plan.plan_restore`) and resumed by the next
epoch: each worker replays its stream to the user's position (:func:`replay_streams`), or the
outlet replays the epoch in the main process. Its runtime keeps a
:class:`~torchdata_snapshot.checkpoint.stream_log.StreamLog` per worker stream, its outlet is a
:class:`~torchdata_snapshot.checkpoint.outlet.ReplayingOutlet`, and with ``num_workers=0`` the
pipeline has global RNG states of its own
(:class:`~torchdata_snapshot.checkpoint.in_process.IsolatedInProcess`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple, cast

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._constants import NO_EPOCH
from torchdata_snapshot._errors import CheckpointError
from torchdata_snapshot.checkpoint.format import Checkpoint, WorkerPosition
from torchdata_snapshot.checkpoint.identity import GraphIdentity, graph_identity
from torchdata_snapshot.checkpoint.in_process import IsolatedInProcess
from torchdata_snapshot.checkpoint.outlet import ReplayingOutlet
from torchdata_snapshot.checkpoint.replay import ReplayProgressLog
from torchdata_snapshot.checkpoint.restore_plan import (
    PendingRestore,
    log_refusal,
    logs_refusals,
    plan_restore,
    rewind,
    sharding_of,
)
from torchdata_snapshot.checkpoint.seeds import seed_state
from torchdata_snapshot.checkpoint.stream_log import StreamLog, replay_request
from torchdata_snapshot.core.main.consumer import WorkerConsumer
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.runtime import Runtime, start_workers
from torchdata_snapshot.core.messages import ElasticEpoch
from torchdata_snapshot.core.options import RuntimeOptions
from torchdata_snapshot.core.seeding import seeding_epoch
from torchdata_snapshot.core.session import Session
from torchdata_snapshot.core.traversal import traverse

__all__ = [
    "CheckpointSession",
    "RestorePlan",
    "checkpoint_before_start",
    "replay_streams",
    "stream_positions",
]

logger = logging.getLogger(__name__)


#: The graph of a reading service that has not run.
_NO_GRAPH = GraphIdentity("")


def checkpoint_before_start(
    num_workers: int, graph: GraphIdentity = _NO_GRAPH, sharding: Tuple[int, int] = (1, 0)
) -> Dict[str, Any]:
    """The checkpoint before any epoch started: no position (of a reading service that has not
    run, or of ``graph``, sharded ``sharding``, before its first epoch)."""
    workers = (WorkerPosition(),) * num_workers
    return Checkpoint(num_workers, graph, epoch=NO_EPOCH, workers=workers, sharding=sharding).to_plain()


class RestorePlan(NamedTuple):
    """A restore, validated (see :meth:`CheckpointSession.plan`)."""

    state: Checkpoint  # as restored: a data directory that moved is where it is now
    graph: GraphIdentity
    sharding: Tuple[int, int]
    pending: Optional[PendingRestore]
    moved: bool  # the data directory moved: ``state`` is not the one taken


def replay_streams(
    consumer: WorkerConsumer, epoch: int, positions: Sequence[WorkerPosition], next_worker: int
) -> None:
    """Bring each worker of ``consumer``, freshly reset to ``epoch``, to its restored position:
    it replays (and drops) the items the user already had, from its recorded graph state if it
    has one, checking their running digest; the round-robin resumes at ``next_worker``."""
    consumer.links.progress = ReplayProgressLog()
    requests = [replay_request(epoch, position) for position in positions]
    consumer.replay(requests, positions, next_worker)


def stream_positions(consumer: WorkerConsumer, delivered: Sequence[int]) -> Tuple[WorkerPosition, ...]:
    """What a checkpoint records of each worker's stream at the user's position in it."""
    with consumer.links.lock:
        return tuple(
            cast(StreamLog, stream.log).position(at) for stream, at in zip(consumer.streams, delivered)
        )


def _log_restore(resume: PendingRestore, epoch: int, seconds: float, start_s: float = 0.0) -> None:
    """Say at INFO how ``epoch`` was resumed, how many items the workers replayed for it and what
    that took (``seconds``: the epoch's reset and the replay; ``start_s``: the workers' start,
    which the restore waited for first, said apart). A replay in the main process happens at the
    first item: the outlet logs it then."""
    checkpoint = resume.checkpoint
    after = f" (after the workers' start, {start_s:.3f} s)" if start_s >= 0.001 else ""
    if resume.resharded_from is not None:
        assert resume.elastic is not None  # an elastic start always has its levels
        old_workers, old_ranks = resume.resharded_from
        ranks = 1 if checkpoint.sharding is None else checkpoint.sharding[0]
        logger.info(
            "restored epoch %d elastically, from %d workers x %d ranks to %d workers x %d ranks: the %d "
            "elements the user had received whole are skipped and the others dealt over the new workers "
            "(%d captured states to start from), in %.3f s%s",
            epoch,
            old_workers,
            old_ranks,
            checkpoint.num_workers,
            ranks,
            sum(resume.elastic.levels[-1].whole),
            len(resume.elastic.head_states),
            seconds,
            after,
        )
        return
    if checkpoint.replay_in_main and checkpoint.delivered:
        return  # replayed by the outlet, at the first item
    replayed = sum(w.delivered - (0 if w.state is None else w.state[0]) for w in checkpoint.workers)
    started = [w for w in checkpoint.workers if w.delivered]
    from_states = sum(w.state is not None for w in started)
    if not started:
        how = "with nothing to replay"
    elif from_states == len(started):
        how = "from captured states"
    elif not from_states:
        how = "by replay"
    else:
        how = f"from captured states in {from_states} of {len(started)} workers, by replay in the others"
    logger.info(
        "restored epoch %d at item %d (%d workers) %s: %d items replayed, in %.3f s%s",
        epoch,
        checkpoint.delivered,
        checkpoint.num_workers,
        how,
        replayed,
        seconds,
        after,
    )


@dataclass
class CheckpointSession(Session):
    """A :class:`Session` that checkpoints and restores (see the module's docstring).

    ``pending``, set by a restore, is resumed by the next :meth:`start_epoch`.
    """

    graph: GraphIdentity = _NO_GRAPH
    sharding: Tuple[int, int] = (1, 0)  # (world_size, rank) of the graph's sharding filter
    pending: Optional[PendingRestore] = None
    epoch_seed: Optional[dict] = None  # SeedGenerator state at the start of the epoch
    elastic: Optional[ElasticEpoch] = None  # the epoch resumed elastically (see ElasticEpoch)

    # --- what a session of this class starts ----------------------------------------------------

    @classmethod
    def _restored(cls, datapipe: DataPipe, plan: Any) -> Dict[str, Any]:
        if plan is None:
            graph = traverse(datapipe)
            return {"graph": graph_identity(datapipe, graph), "sharding": sharding_of(datapipe, graph)}
        restore = cast(RestorePlan, plan)
        pending = restore.pending
        epoch = restore.state.epoch if pending is None else restore.state.epoch - 1  # the last started
        return {"graph": restore.graph, "sharding": restore.sharding, "epoch": epoch, "pending": pending}

    @classmethod
    def _start_runtime(cls, datapipe: DataPipe, options: RuntimeOptions) -> Runtime:
        if options.num_workers:
            return start_workers(datapipe, options, StreamLog)
        return IsolatedInProcess(datapipe, options.worker.custom_init_fn, options.isolate_rng)

    @classmethod
    def _outlet(cls, runtime: Runtime, options: RuntimeOptions) -> Outlet:
        return ReplayingOutlet(
            runtime.end,
            runtime.positions,
            verify=options.worker.restore.verify_replay,
            rng=getattr(runtime, "rng", None),
            read_ahead=options.read_ahead,
        )

    # --- checkpoints ----------------------------------------------------------------------------

    @classmethod
    def before_start(cls, num_workers: int) -> Dict[str, Any]:
        return checkpoint_before_start(num_workers)

    @classmethod
    @logs_refusals
    def plan(cls, datapipe: DataPipe, state: Any, num_workers: int, elastic: bool) -> RestorePlan:
        """What restoring ``state`` for ``datapipe`` resumes, validated; nothing starts."""
        traversed = traverse(datapipe)
        sharding, graph = sharding_of(datapipe, traversed), graph_identity(datapipe, traversed)
        taken = Checkpoint.from_plain(state)
        restored, moved = cls._relocated(taken, datapipe, graph)
        pending = plan_restore(restored, datapipe, graph, sharding, num_workers, elastic)
        return RestorePlan(restored, graph, sharding, pending, moved)

    @classmethod
    def _relocated(
        cls, taken: Checkpoint, datapipe: DataPipe, graph: GraphIdentity
    ) -> Tuple[Checkpoint, bool]:
        """``taken`` as it resumes for ``datapipe``, and whether its data moved (it cannot here:
        a checkpoint whose data directory moved resumes where the graph's readers are restored)."""
        return taken, False

    def checkpoint(self) -> Dict[str, Any]:
        """The checkpoint at the user's position, as plain data (see ``checkpoint.format``)."""
        if self.epoch == NO_EPOCH:
            return checkpoint_before_start(self.num_workers, self.graph, self.sharding)
        outlet = cast(ReplayingOutlet, self.outlet)
        positions = outlet.positions
        return Checkpoint(
            num_workers=self.num_workers,
            graph=self.graph,
            epoch=self.epoch,
            status="finished" if outlet.finished else "in_epoch",
            seed=self.epoch_seed,
            delivered=outlet.delivered,
            replay_in_main=positions is None,
            digest=None if positions is not None else outlet.digest,
            workers=self._worker_positions(),
            next_worker=0 if positions is None else positions.next_worker,
            sharding=self.sharding,
            remaining=() if self.elastic is None else self.elastic.levels,
        ).to_plain()

    def _worker_positions(self) -> Tuple[WorkerPosition, ...]:
        """What a checkpoint records of each worker's stream at the user's position (without
        workers, nothing; without tracked positions, the outlet replays: every worker restarts
        at the epoch's beginning)."""
        consumer: Optional[WorkerConsumer] = getattr(self.runtime, "consumer", None)
        if consumer is None:
            return ()
        positions = self.outlet.positions
        if positions is None:
            return (WorkerPosition(),) * self.num_workers
        return stream_positions(consumer, positions.delivered)

    # --- epochs ---------------------------------------------------------------------------------

    def start_epoch(self, seed_generator: SeedGenerator, iter_reset_fn: Any) -> None:
        """Start the next epoch with ``seed_generator``'s seeds, or the restored one where it stopped."""
        pending, self.pending = self.pending, None
        resume = rewind(pending, seed_generator)
        self.epoch += 1
        if pending is not None and resume is None:
            logger.info("epoch %d of the checkpoint starts again at its beginning, as asked", self.epoch)
        self.epoch_seed = seed_state(seed_generator)
        self.elastic = None if resume is None else resume.elastic
        started = time.time()  # (compared with the workers' own clock readings)
        replay = None
        if resume is not None and not resume.checkpoint.replay_in_main:
            checkpoint, epoch = resume.checkpoint, self.epoch

            def replay(consumer: WorkerConsumer) -> None:
                replay_streams(consumer, epoch, checkpoint.workers, checkpoint.next_worker)

        try:
            with seeding_epoch(seed_generator, in_workers=bool(self.num_workers)):
                self.runtime.start_epoch(
                    self.outlet, self.epoch, seed_generator, iter_reset_fn, self.elastic, replay
                )
        except CheckpointError as e:  # a file changed, replay diverged, a state did not load
            if resume is not None:
                log_refusal(e, f" while epoch {self.epoch} was restored")
            raise
        cast(ReplayingOutlet, self.outlet).start_epoch_at(
            self.epoch, None if resume is None else resume.checkpoint
        )
        if resume is not None:
            consumer = getattr(self.runtime, "consumer", None)
            serving = None if consumer is None else consumer.workers_serving_since
            begun = started if serving is None else max(started, serving)
            _log_restore(resume, self.epoch, time.time() - begun, begun - started)
