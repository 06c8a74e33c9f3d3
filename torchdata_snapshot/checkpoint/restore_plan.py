"""Restore planning: which epoch a restored reading service resumes, and how.

``MultiProcessingReadingService.restore()`` validates the state against the graph and the
service's configuration before any process starts (:func:`plan_restore`), and keeps the
:class:`PendingRestore` it gets until the next ``initialize_iteration`` starts that epoch: an
exact resume (the same ``num_workers`` and world size: each worker replays its stream, or the
main process replays the user's position), or, with ``elastic=True``, the epoch's start over
the elements the user had not received (elastic resume, an optional feature: see
:data:`ElasticStart`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, TypeVar

from torchdata.dataloader2.graph import DataPipe, DataPipeGraph
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._errors import CheckpointError, IncompatibleCheckpointError, InvalidCheckpointError
from torchdata_snapshot.checkpoint.format import Checkpoint
from torchdata_snapshot.checkpoint.identity import GraphIdentity
from torchdata_snapshot.checkpoint.seeds import drawn_by_unseeded_dataloader2, load_seed_state, seed_state
from torchdata_snapshot.core.graph import sharding_layout, sharding_point
from torchdata_snapshot.core.messages import ElasticEpoch
from torchdata_snapshot.core.plugins import installed, require

__all__ = [
    "ElasticStart",
    "PendingRestore",
    "log_refusal",
    "logs_refusals",
    "plan_restore",
    "rewind",
    "sharding_of",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def log_refusal(error: CheckpointError, when: str = "") -> None:
    """Say at WARNING that a restore was refused, and why (the error is raised all the same: the
    record is for the job's log, where the traceback may not end up)."""
    logger.warning("the checkpoint was refused%s: %s: %s", when, type(error).__name__, error)


def logs_refusals(restore: F) -> F:
    """``restore`` (the reading service's planning of one), logging a checkpoint it refuses
    before any process starts (:func:`log_refusal`): invalid, incompatible, or files that are not
    the same where the data moved."""

    @functools.wraps(restore)
    def logged(*args: Any, **kwargs: Any) -> Any:
        try:
            return restore(*args, **kwargs)
        except CheckpointError as e:
            log_refusal(e)
            raise

    return logged  # type: ignore[return-value]


@dataclass(frozen=True)
class PendingRestore:
    """An epoch to resume: what the next ``initialize_iteration`` needs to start it."""

    #: The state taken in the epoch, laid out for this service: one position per worker and this
    #: rank's seeds (an elastic start's positions are the epoch's start over what remains).
    checkpoint: Checkpoint
    #: The epoch resumes elastically (its levels, and the graph states that give the new workers
    #: a head start), or ``None``. Never set for ``num_workers=0``: only workers run one.
    elastic: Optional[ElasticEpoch] = None
    #: ``(num_workers, world_size)`` of the checkpoint when the epoch starts elastically over
    #: another layout (``None``: the checkpoint's own layout resumes), for the restore's log.
    resharded_from: Optional[Tuple[int, int]] = None


#: Elastic resume (an optional feature, ``elastic_start`` in :mod:`torchdata_snapshot.core.plugins`),
#: in restore planning: ``(state, datapipe, sharding, num_workers)`` -> the start of ``state``'s
#: epoch for another number of workers or ranks (``sharding``: this rank's ``(world_size, rank)``),
#: or ``IncompatibleCheckpointError`` when it cannot be exact.
ElasticStart = Callable[[Checkpoint, DataPipe, Tuple[int, int], int], "PendingRestore"]


def sharding_of(datapipe: DataPipe, graph: Optional[DataPipeGraph] = None) -> Tuple[int, int]:
    """``(world_size, rank)`` the graph's sharding filter was given (``(1, 0)`` without one;
    ``graph``: ``datapipe``'s, if the caller traversed it already)."""
    sf = sharding_point(datapipe, graph)
    return (1, 0) if sf is None else sharding_layout(sf)


def plan_restore(
    state: Checkpoint,
    datapipe: DataPipe,
    graph: GraphIdentity,
    sharding: Tuple[int, int],
    num_workers: int,
    elastic: bool,
) -> Optional[PendingRestore]:
    """The epoch that restoring ``state`` for ``datapipe`` (whose identity is ``graph`` and
    sharding ``sharding``, see :func:`sharding_of`) resumes with ``num_workers`` workers
    (``elastic``: the service's option), or ``None`` if ``state`` was taken outside an epoch.

    Raises :class:`~torchdata_snapshot.IncompatibleCheckpointError` if the state does not fit
    the graph or the service's layout (and cannot resume elastically).
    """
    state = state.for_rank(sharding)
    same_layout = state.num_workers == num_workers and (
        state.sharding is None or state.sharding[0] == sharding[0]
    )
    if state.status == "idle" and same_layout:
        _log_fresh_start(state)
        return None  # nothing of an epoch to resume
    if same_layout or not elastic:
        state.check_fits(num_workers, graph, sharding)
    else:
        state.check_graph(graph)
        if state.status == "in_epoch":
            elastic_start: ElasticStart = require("elastic_start", "elastic=True")
            return elastic_start(state, datapipe, sharding, num_workers)
    if state.status != "in_epoch":
        _log_fresh_start(state)
        return None
    if not state.remaining:
        return PendingRestore(state)
    if installed().elastic_worker is None:
        raise IncompatibleCheckpointError(
            "the state was taken in an epoch resumed elastically; its workers resume it with "
            "torchdata_snapshot.elastic, which this installation lacks"
        )
    if not num_workers:  # no state of ours: an elastic epoch runs in workers
        raise InvalidCheckpointError(
            "a state taken with num_workers=0 cannot hold the levels of an elastic epoch"
        )
    return PendingRestore(state, ElasticEpoch(state.remaining))


def _log_fresh_start(state: Checkpoint) -> None:
    """A restore with nothing of an epoch to resume says so (the others are logged once their
    epoch is resumed, with what that took: :mod:`torchdata_snapshot.core.session`)."""
    if state.status == "idle":
        logger.info("restoring a checkpoint taken before any epoch: the first epoch starts at its beginning")
    else:
        logger.info(
            "restoring a checkpoint taken after epoch %d ended: epoch %d starts at its beginning",
            state.epoch,
            state.epoch + 1,
        )


def rewind(pending: Optional[PendingRestore], seed_generator: SeedGenerator) -> Optional[PendingRestore]:
    """The restore that the epoch DataLoader2 starts with ``seed_generator`` resumes: ``pending``,
    with the generator put back, in place, to where that epoch started; or ``None``, when there
    is none or DataLoader2 asks to replay the saved epoch from its beginning."""
    if pending is None:
        return None
    at_saved_epochs_start = seed_state(seed_generator) == pending.checkpoint.seed
    if at_saved_epochs_start and not drawn_by_unseeded_dataloader2(seed_generator):
        # DataLoader2._restore_checkpoint_beginning_of_epoch() hands over the generator as it
        # was when the saved epoch started: torchdata's meaning is to replay that epoch from
        # its beginning, so it starts afresh, with those seeds. (Unseeded, DataLoader2 draws
        # a new generator at every iter(), which that call cannot change; a fresh process may
        # draw the saved epoch's by chance: the epoch still resumes where it stopped.)
        return None
    # The generator DataLoader2 hands over was saved *after* this epoch's seeding (and
    # DistributedReadingService may have advanced it again): put it back, in place, to
    # where this epoch started, so that this epoch and every later one get the seeds
    # of the uninterrupted run.
    load_seed_state(seed_generator, pending.checkpoint.seed)
    return pending
