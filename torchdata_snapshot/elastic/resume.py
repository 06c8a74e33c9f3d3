"""Elastic resume: the rest of an epoch with another number of workers or ranks.

``MultiProcessingReadingService(..., elastic=True)`` restores a checkpoint taken with another
``num_workers`` (or world size) by running the epoch again from its seeds over the elements the
user had not received (:mod:`torchdata_snapshot.elastic.remaining`). That is exact when what the user
received is a prefix of each sharding instance's elements, the last of them possibly in part:
every DataPipe between the sharding point and the user must hand on the items of the elements
it took as soon as it can, holding none back across its outputs, but for one that yields
several items per element (a reader, ``flatmap``, ``unbatch``: an *expander*), whose position
inside its current element each item records (:mod:`torchdata_snapshot.elastic.element_progress`); a
new worker deals that element again and skips the items the user had. ``elastic_refusal``
checks the graph; the checkpoint must know every instance's counts, over all ranks of a
distributed job (``gather_elastic_state``).

Whether a DataPipe holds elements depends on its code, not on the class it derives from: a
subclass of ``map`` may keep an item back. So the check matches exact types: torchdata's
(``ELASTIC_AFTER_SHARDING``), and classes their author declared with
:func:`~torchdata_snapshot.register_elastic`. The declaration is an attribute of the class
itself, not an entry in a table of this module; the check runs in the process that restores,
before any worker starts.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.selecting import FilterIterDataPipe
from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, find_dps
from torchdata.dataloader2.graph.utils import _find_replicable_branches
from torchdata.dataloader2.utils.dispatch import find_lca_round_robin_sharding_dp

from torchdata_snapshot._errors import IncompatibleCheckpointError, InvalidCheckpointError
from torchdata_snapshot.checkpoint.format import FORMAT, Checkpoint, ShardingProgress
from torchdata_snapshot.core.catalogue import types_where
from torchdata_snapshot.core.graph import describe_datapipe
from torchdata_snapshot.core.main.positions import ONE_TO_ONE_TAIL, not_one_to_one
from torchdata_snapshot.core.messages import Level
from torchdata_snapshot.core.traversal import traverse
from torchdata_snapshot.core.worker.worker_graph import DispatchPlaceholder
from torchdata_snapshot.elastic.element_progress import EXPANDING, HOLDING_ONE, ONE_TO_ONE, chain_after

__all__ = [
    "ELASTIC_AFTER_SHARDING",
    "elastic_refusal",
    "expands_after_sharding",
    "gather_elastic_state",
    "register_elastic",
    "replicable_branch",
    "resume_levels",
]

#: DataPipes that may stand between the sharding point and the user in an elastic graph, by
#: exact type: when one of them yields, it holds no element it took (a batch yields once full,
#: and is empty then). A subclass may hold some: it needs its own :func:`register_elastic`.
ELASTIC_AFTER_SHARDING: Tuple[type, ...] = types_where(after_sharding=True)

#: The class attribute in which :func:`register_elastic` records a declaration: the class it
#: was made for, so that a subclass, which inherits the attribute, is not taken as declared.
_DECLARED_ELASTIC = "_dataloader2_elastic"

_DataPipeType = TypeVar("_DataPipeType", bound=type)


def register_elastic(datapipe_type: _DataPipeType) -> _DataPipeType:
    """Declare that DataPipes of exactly ``datapipe_type`` may run between ``sharding_filter``
    and the user in a graph that resumes elastically (``MultiProcessingReadingService(...,
    elastic=True)``), as the ``map``, ``filter``, ``batch`` and ``collate`` do.

    Declare only a class that, whenever it yields, holds none of the elements it took: each was
    handed on whole (in this output or an earlier one) or dropped. One that keeps an element
    back (a buffer, a pair) or yields an element's items over several outputs would lose or
    repeat elements on an elastic resume. The declaration covers the class, not its subclasses.
    It is an attribute of the class: declared where the class is defined (as a class decorator:
    ``datapipe_type`` is returned), it holds in every process that imports the class, the
    restoring one among them (the check runs there, before any worker starts).

    Args:
        datapipe_type: an ``IterDataPipe`` class; returned, so that this works as a decorator.
    """
    if not (isinstance(datapipe_type, type) and issubclass(datapipe_type, IterDataPipe)):
        raise TypeError(f"register_elastic() takes an IterDataPipe class, got {datapipe_type!r:.200}")
    setattr(datapipe_type, _DECLARED_ELASTIC, datapipe_type)
    return datapipe_type  # type: ignore[return-value, unused-ignore]  # (mypy 1.8 narrows the TypeVar away)


def _is_elastic(datapipe: DataPipe) -> bool:
    """Whether ``datapipe`` may run after the sharding point of an elastic graph: its exact type
    is one of :data:`ELASTIC_AFTER_SHARDING` or was declared with :func:`register_elastic`."""
    kind = type(datapipe)
    return kind in ELASTIC_AFTER_SHARDING or getattr(kind, _DECLARED_ELASTIC, None) is kind


def replicable_branch(datapipe: DataPipe) -> DataPipe:
    """The part of ``datapipe`` that worker processes run (its end), as DataLoader2 splits it."""
    branches = _find_replicable_branches(traverse(datapipe))
    return branches[0] if len(branches) == 1 else datapipe


def elastic_refusal(datapipe: DataPipe, replicable: Optional[DataPipe] = None) -> Optional[str]:
    """Why an epoch of ``datapipe`` cannot resume with another number of workers or ranks, or
    ``None`` if it can.

    It can when the graph has one sharding filter, no dispatching process, and between the
    sharding filter and the end of ``replicable`` (the part the workers run: ``datapipe``
    itself if not given) a chain of DataPipes (by exact type) that hold no element back: those
    of :data:`ELASTIC_AFTER_SHARDING` and :data:`ONE_TO_ONE`, classes declared with
    :func:`register_elastic`, and at most one of :data:`EXPANDING` with, after it, those of
    :data:`HOLDING_ONE` too, and before it only :data:`ONE_TO_ONE` and ``filter``.
    """
    graph = traverse(datapipe)
    if find_lca_round_robin_sharding_dp(graph) is not None or find_dps(graph, DispatchPlaceholder):
        return "the graph uses sharding_round_robin_dispatch, whose dispatching process is not elastic"
    found = find_dps(graph, ShardingFilterIterDataPipe)
    if len(found) != 1:
        return f"the graph has {len(found)} sharding_filter DataPipes; an elastic graph has exactly one"
    chain = chain_after(found[0], replicable if replicable is not None else datapipe)
    if not isinstance(chain, list):
        return _refused(chain)
    expanders = [i for i, dp in enumerate(chain) if type(dp) in EXPANDING]
    if len(expanders) > 1:
        return (
            f"DataPipe {describe_datapipe(chain[expanders[1]])} yields several items per element after "
            f"{describe_datapipe(chain[expanders[0]])}, which does too: an elastic graph has at most one "
            "such DataPipe after sharding_filter"
        )
    at = expanders[0] if expanders else -1
    for i, dp in enumerate(chain):
        if i < at and type(dp) not in (*ONE_TO_ONE, FilterIterDataPipe):
            return _refused(dp, before=chain[at])
        holding = at >= 0 and type(dp) in HOLDING_ONE
        if i > at and not (_is_elastic(dp) or type(dp) in ONE_TO_ONE or holding):
            return _refused(dp)
    return None


def _names(kinds: Sequence[type]) -> str:
    return ", ".join(dict.fromkeys(kind.__name__ for kind in kinds))


def _refused(dp: DataPipe, before: Optional[DataPipe] = None) -> str:
    if before is not None:
        return (
            f"DataPipe {describe_datapipe(dp)} runs between sharding_filter and "
            f"{describe_datapipe(before)}, which yields several items per element: only "
            f"{_names((*ONE_TO_ONE, FilterIterDataPipe))} may (exactly these classes), so that the "
            "element it expands is the one the sharding filter yielded last"
        )
    return (
        f"DataPipe {describe_datapipe(dp)} runs after sharding_filter: only "
        f"{_names((*ELASTIC_AFTER_SHARDING, *ONE_TO_ONE))} (exactly these classes, not subclasses), "
        "classes declared with torchdata_snapshot.register_elastic(), and one of "
        f"{_names(EXPANDING)} followed by any of those or of {_names(HOLDING_ONE)} may, in a chain "
        "(a DataPipe that holds elements across its outputs, such as shuffle, bucketbatch or a "
        "subclass of map that keeps an item back, would lose or repeat them when the elements are "
        "dealt to other workers)"
    )


def expands_after_sharding(datapipe: DataPipe) -> bool:
    """Whether one of :data:`EXPANDING` runs after the graph's sharding point."""
    found = find_dps(traverse(datapipe), ShardingFilterIterDataPipe)
    if len(found) != 1:
        return False
    chain = chain_after(found[0], replicable_branch(datapipe))
    return isinstance(chain, list) and any(type(dp) in EXPANDING for dp in chain)


def resume_levels(state: Checkpoint, datapipe: DataPipe) -> Tuple[Level, ...]:
    """The levels of an elastic resume of ``state``'s epoch: those of earlier elastic resumes,
    then what the user had received at ``state``, over every rank. Raises
    :class:`IncompatibleCheckpointError` if the checkpoint does not tell (``datapipe``, the graph
    being restored, tells why when the position was replayed in the main process)."""
    if state.replay_in_main or state.sharding is None:
        reason = (
            _why_replayed_in_main(state, datapipe)
            if state.replay_in_main
            else "it was taken by an older version of this reading service, which did not record "
            "sharding positions"
        )
        raise IncompatibleCheckpointError(f"the checkpoint cannot resume elastically: {reason}")
    world_size, _ = state.sharding
    if world_size == 1:
        ranks: Sequence[Sequence[ShardingProgress]] = [_progress(state)]
    elif state.ranks is None:
        raise IncompatibleCheckpointError(
            f"the checkpoint of a job of {world_size} ranks holds only its own rank's positions: to resume "
            "it with another number of workers or ranks, save the state that "
            "torchdata_snapshot.gather_elastic_state(dl.state_dict()) returns (called on every rank)"
        )
    else:
        ranks = [_progress(rank) for rank in state.ranks]
    progress = [p for rank in ranks for p in rank]
    if any(taken is None for taken, _ in progress):
        raise IncompatibleCheckpointError(
            "the checkpoint cannot resume elastically: its workers did not count their sharding "
            "positions (the graph has no single sharding_filter, or uses sharding_round_robin_dispatch)"
        )
    expands = expands_after_sharding(datapipe)
    if expands and any(taken and partial is None for taken, partial in progress):
        raise IncompatibleCheckpointError(
            "the checkpoint cannot resume elastically: it does not record how far into their elements "
            "the workers' one-to-many DataPipe after sharding_filter was (it was taken by an older "
            "version of this reading service)"
        )
    last = [_level_entry(taken, partial if expands else None) for taken, partial in progress]  # type: ignore[arg-type]
    return (*state.remaining, Level(tuple(w for w, _ in last), tuple(p for _, p in last)))


def _progress(state: Checkpoint) -> Tuple[ShardingProgress, ...]:
    """``(taken, partial)`` of each worker of ``state``."""
    return tuple((w.taken, w.partial) for w in state.workers)


def _level_entry(taken: int, partial: Optional[int]) -> Tuple[int, int]:
    """``(whole, partial)`` of an instance whose filter had taken ``taken`` elements: with an
    expander, the last of them was handed on in part (``partial`` items), possibly none or all."""
    if partial is None or not taken:
        return taken, 0
    return taken - 1, partial


def _why_replayed_in_main(state: Checkpoint, datapipe: DataPipe) -> str:
    """Why ``state`` holds no position in its workers' streams (the main process replays the
    user's position instead), named from ``datapipe``, the graph being restored."""
    if state.num_workers == 0:
        return (
            "it was taken with num_workers=0: the graph ran in the main process, so the checkpoint "
            "holds no position in any worker's stream"
        )
    culprits = not_one_to_one(datapipe, replicable_branch(datapipe))
    if not culprits:  # not for the graph that was checkpointed (its fingerprint matched)
        return "its position is replayed in the main process, not recorded per worker"
    return (
        "it was taken with DataPipes after the workers, in the main process, that are not known to "
        f"hand on one item per item: {', '.join(describe_datapipe(dp) for dp in culprits)} (only "
        f"{', '.join(kind.__name__ for kind in ONE_TO_ONE_TAIL)} are, by exact class), so it does not "
        "tell how far the user got into each worker's stream (a restore with the same num_workers "
        "replays the position in the main process)"
    )


def gather_elastic_state(state_dict: Dict[str, Any], group: Optional[Any] = None) -> Dict[str, Any]:
    """This rank's ``DataLoader2.state_dict()``, completed with every rank's state, so that it
    resumes any rank of a new job: exactly, each rank from its own part, with the same world
    size; elastically (``MultiProcessingReadingService(..., elastic=True)``), with another
    world size or ``num_workers``.

    Collective over ``group`` (default: the whole job, through ``torch.distributed``): every
    rank calls it with its own state dict, at the same step. What travels, and what the result
    holds, is every rank's reading-service state (counters, seeds and its workers' DataPipe
    states): the result is about ``world_size`` times this rank's, and the same on every rank
    but for the pipeline and seeds ``DataLoader2`` stores beside it, so one rank may save it
    for all. A job of one rank does not need it (its state already holds everything).

    Args:
        state_dict: this rank's ``DataLoader2.state_dict()``.
        group: the ``torch.distributed`` process group of the job's ranks (``None``: the default
            group).

    Returns:
        ``state_dict`` with every rank's state; it resumes any rank of the new job.
    """
    import torch.distributed as dist

    plain, put_back = _own_state(state_dict)
    mine = replace(Checkpoint.from_plain(plain), ranks=None)
    if mine.sharding is None:
        raise IncompatibleCheckpointError(
            "the state was taken by a version that did not record sharding positions"
        )
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine.to_plain(), group)
    states = [Checkpoint.from_plain(plain) for plain in gathered]
    world_size = mine.sharding[0]
    by_rank = {state.sharding[1]: state for state in states if state.sharding is not None}
    if sorted(by_rank) != list(range(world_size)) or len(states) != world_size:
        raise IncompatibleCheckpointError(
            f"gather_elastic_state needs one state per rank of the job's {world_size} ranks, got ranks "
            f"{[state.sharding and state.sharding[1] for state in states]}"
        )
    if any((s.epoch, s.status) != (mine.epoch, mine.status) for s in states):
        raise IncompatibleCheckpointError(
            "gather_elastic_state: the ranks' states belong to different epochs "
            f"({sorted((r, s.epoch, s.status) for r, s in by_rank.items())}); call it at one step on "
            "every rank"
        )
    if any(s.num_workers != mine.num_workers for s in states):
        raise IncompatibleCheckpointError("gather_elastic_state: the ranks have different numbers of workers")
    ranks = tuple(by_rank[rank] for rank in range(world_size))
    return put_back(replace(mine, ranks=ranks).to_plain())


def _own_state(state_dict: Any) -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], Dict[str, Any]]]:
    """The reading-service state of ours inside ``DataLoader2.state_dict()`` (directly, or in
    ``SequentialReadingService``'s pickled list), and how to put a new one in its place."""
    rs_state = state_dict.get("reading_service_state") if isinstance(state_dict, dict) else None
    if isinstance(rs_state, dict):
        return rs_state, lambda plain: {**state_dict, "reading_service_state": plain}
    if isinstance(rs_state, bytes):
        try:
            states = pickle.loads(rs_state)  # as trusted as the rest of DataLoader2's state
        except Exception:
            states = None
        if isinstance(states, list):
            found = [i for i, s in enumerate(states) if isinstance(s, dict) and s.get("format") == FORMAT]
            if len(found) == 1:

                def put_back(plain: Dict[str, Any]) -> Dict[str, Any]:
                    replaced = [plain if i == found[0] else s for i, s in enumerate(states)]
                    return {**state_dict, "reading_service_state": pickle.dumps(replaced)}

                return states[found[0]], put_back
    raise InvalidCheckpointError(
        "not a DataLoader2.state_dict() holding the state of this reading service "
        "(directly, or inside SequentialReadingService's)"
    )
