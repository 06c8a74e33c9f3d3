"""``Session``: one run of the reading service, from ``initialize`` (or ``restore``) to ``finalize``.

It holds what exists only while the graph runs: the :class:`~torchdata_snapshot.core.main.runtime.Runtime`
and its :class:`~torchdata_snapshot.core.main.outlet.Outlet`, the graph's identity and sharding, and the
epoch in progress (its number, the seeds it started with, the restore it resumes). The reading
service answers DataLoader2's calls and checks their order; what they act on is here, so that a
call is one line there and each operation can be tested without DataLoader2.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._constants import NO_EPOCH
from torchdata_snapshot._errors import CheckpointError
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.checkpoint.format import Checkpoint, WorkerPosition
from torchdata_snapshot.checkpoint.identity import GraphIdentity
from torchdata_snapshot.checkpoint.restore_plan import PendingRestore, log_refusal, rewind
from torchdata_snapshot.checkpoint.seeds import advance_epoch_seed, seed_state
from torchdata_snapshot.core.graph import graph_datapipes, pausable, pause_datapipe, paused
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.runtime import Runtime
from torchdata_snapshot.core.messages import ElasticEpoch

__all__ = ["Session", "checkpoint_before_start"]

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


def _log_restore(resume: PendingRestore, epoch: int, seconds: float) -> None:
    """Say at INFO how ``epoch`` was resumed, how many items the workers replayed for it and what
    that took (``seconds``: the epoch's reset and the replay, the workers' start not counted).
    A replay in the main process happens at the first item: the outlet logs it then."""
    checkpoint = resume.checkpoint
    if resume.resharded_from is not None:
        assert resume.elastic is not None  # an elastic start always has its levels
        old_workers, old_ranks = resume.resharded_from
        ranks = 1 if checkpoint.sharding is None else checkpoint.sharding[0]
        logger.info(
            "restored epoch %d elastically, from %d workers x %d ranks to %d workers x %d ranks: the %d "
            "elements the user had received whole are skipped and the others dealt over the new workers "
            "(%d captured states to start from), in %.3f s",
            epoch,
            old_workers,
            old_ranks,
            checkpoint.num_workers,
            ranks,
            sum(resume.elastic.levels[-1].whole),
            len(resume.elastic.head_states),
            seconds,
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
        "restored epoch %d at item %d (%d workers) %s: %d items replayed, in %.3f s",
        epoch,
        checkpoint.delivered,
        checkpoint.num_workers,
        how,
        replayed,
        seconds,
    )


@dataclass
class Session:
    """The running graph and the epoch in progress (see the module's docstring).

    ``epoch`` is the last epoch started (``NO_EPOCH`` before the first); ``pending``, set by a
    restore, is resumed by the next :meth:`start_epoch`.
    """

    runtime: Runtime
    outlet: Outlet
    num_workers: int
    graph: GraphIdentity
    sharding: Tuple[int, int]  # (world_size, rank) of the graph's sharding filter
    epoch: int = NO_EPOCH
    pending: Optional[PendingRestore] = None
    epoch_seed: Optional[dict] = None  # SeedGenerator state at the start of the epoch
    elastic: Optional[ElasticEpoch] = None  # the epoch resumed elastically (see ElasticEpoch)
    paused: bool = False
    main_datapipes: List[DataPipe] = field(init=False)  # what runs in this process

    def __post_init__(self) -> None:
        self.main_datapipes = [dp for _, dp in graph_datapipes(self.outlet)]

    @property
    def broken(self) -> bool:
        return self.runtime.broken is not None

    def start_epoch(
        self, seed_generator: SeedGenerator, iter_reset_fn: Optional[Callable[[DataPipe], DataPipe]]
    ) -> None:
        """Start the next epoch with ``seed_generator``'s seeds, or the restored one where it stopped."""
        pending, self.pending = self.pending, None
        resume = rewind(pending, seed_generator)
        self.epoch += 1
        if pending is not None and resume is None:
            logger.info("epoch %d of the checkpoint starts again at its beginning, as asked", self.epoch)
        self.epoch_seed = seed_state(seed_generator)
        advance_epoch_seed(seed_generator)
        self.elastic = None if resume is None else resume.elastic
        started = time.monotonic()
        try:
            self.runtime.start_epoch(self.outlet, self.epoch, seed_generator, iter_reset_fn, resume)
        except CheckpointError as e:  # a file changed, replay diverged, a state did not load
            if resume is not None:
                log_refusal(e, f" while epoch {self.epoch} was restored")
            raise
        self.outlet.start_epoch_at(self.epoch, None if resume is None else resume.checkpoint)
        if resume is not None:
            _log_restore(resume, self.epoch, time.monotonic() - started)

    def checkpoint(self) -> Dict[str, Any]:
        """The checkpoint at the user's position, as plain data (see ``checkpoint.format``)."""
        if self.epoch == NO_EPOCH:
            return checkpoint_before_start(self.num_workers, self.graph, self.sharding)
        positions = self.outlet.positions
        return Checkpoint(
            num_workers=self.num_workers,
            graph=self.graph,
            epoch=self.epoch,
            status="finished" if self.outlet.finished else "in_epoch",
            seed=self.epoch_seed,
            delivered=self.outlet.delivered,
            replay_in_main=positions is None,
            digest=None if positions is not None else self.outlet.digest,
            workers=self.runtime.worker_positions(positions),
            next_worker=0 if positions is None else positions.next_worker,
            sharding=self.sharding,
            remaining=() if self.elastic is None else self.elastic.levels,
        ).to_plain()

    def pause(self, pause_fn: Optional[Callable[[DataPipe], DataPipe]]) -> None:
        """Pause main-process DataPipes (prefetchers, ``fullsync``), then the workers."""
        for dp in pausable(self.main_datapipes):
            pause_datapipe(dp)
        self.runtime.pause(pause_fn)
        self.paused = True

    def resume(self, resume_fn: Optional[Callable[[DataPipe], DataPipe]]) -> None:
        self.runtime.resume(resume_fn)
        for dp in reversed(pausable(self.main_datapipes)):
            dp.resume()
        self.paused = False

    def limit(
        self, num_batches: Optional[int], limit_fn: Callable[[DataPipe, Optional[int]], DataPipe]
    ) -> None:
        self.runtime.limit(num_batches, limit_fn)
        limit_fn(self.outlet, num_batches)

    def snapshot(self) -> List[WorkerSnapshot]:
        """One snapshot per process running the graph, with main-process threads paused."""
        with paused([] if self.paused else pausable(self.main_datapipes)):
            return self.runtime.snapshot(self.outlet, self.epoch, self.paused)
