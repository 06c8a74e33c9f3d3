"""Where an epoch resumed elastically starts: the epoch's start for the new layout, dealing only
the elements the user had not received (plugged into restore planning as ``elastic_start``; see
:mod:`torchdata_snapshot.core.plugins`)."""

from __future__ import annotations

from typing import Tuple

from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._errors import IncompatibleCheckpointError
from torchdata_snapshot.checkpoint.format import Checkpoint, WorkerPosition
from torchdata_snapshot.checkpoint.restore_plan import PendingRestore
from torchdata_snapshot.checkpoint.seeds import rank_seed_state
from torchdata_snapshot.core.messages import ElasticEpoch
from torchdata_snapshot.elastic.resume import elastic_refusal, replicable_branch, resume_levels

__all__ = ["elastic_start"]


def elastic_start(
    state: Checkpoint, datapipe: DataPipe, sharding: Tuple[int, int], num_workers: int
) -> PendingRestore:
    """The start of ``state``'s epoch for ``num_workers`` workers and this rank, dealing only
    the elements the user had not received (see :mod:`torchdata_snapshot.elastic.resume`); the graph
    states the old workers captured give the new ones a head start."""
    refusal = "elastic resume needs worker processes (num_workers >= 1)" if not num_workers else None
    refusal = refusal or elastic_refusal(datapipe, replicable_branch(datapipe))
    if refusal is not None:
        raise IncompatibleCheckpointError(
            f"the epoch cannot resume with another number of workers or ranks: {refusal}"
        )
    levels = resume_levels(state, datapipe)
    assert state.sharding is not None  # resume_levels checked it
    first_instance = state.sharding[1] * state.num_workers
    head_states = tuple((first_instance + i, w.state[1]) for i, w in enumerate(state.workers) if w.state)
    start = Checkpoint(
        num_workers=num_workers,
        graph=state.graph,
        epoch=state.epoch,
        status="in_epoch",
        # Another rank's state may be loaded: the seeds are put back to this rank's.
        seed=rank_seed_state(state.seed, sharding[1]) if sharding[0] > 1 and state.seed else state.seed,
        workers=(WorkerPosition(taken=0),) * num_workers,
        sharding=sharding,
        remaining=levels,
    )
    return PendingRestore(
        start, ElasticEpoch(levels, head_states), resharded_from=(state.num_workers, state.sharding[0])
    )
