"""Finding a DataPipe graph, and seeding it, at the cost of its DataPipes rather than of its data.

torch's ``traverse_dps`` finds a DataPipe's inputs by pickling it with hooks that stub out the
DataPipes it meets. What else the DataPipe holds in a collection is pickled too: an
``IterableWrapper`` over 40,000 tensors (``examples/dataloader2/train_loop_reading_service.py``)
costs about 1.8 s a traversal, and torchdata traverses a graph several times per epoch in every process
(``set_graph_random_seed`` once, then once more per sharding filter, twice with ``list_dps``'s
exclusions). :func:`traverse` returns the same graph, but passes over the values that cannot
hold a DataPipe (tensors, storages, numeric arrays) without pickling them; :func:`seed_graph`
and :func:`reset_graph` do what torchdata's ``set_graph_random_seed`` and ``process_reset_fn``
do, on one traversal, drawing the same seeds in the same order.
"""

from __future__ import annotations

import functools
import pickle
import sys
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, DataPipeGraph, find_dps, list_dps
from torchdata.dataloader2.graph.settings import set_datapipes_seed
from torchdata.dataloader2.graph.utils import _replace_dp as replace_in_inputs
from torchdata.dataloader2.random import SeedGenerator

if TYPE_CHECKING:
    from torchdata.dataloader2.utils.worker import WorkerInfo

__all__ = ["datapipes_in", "replace", "reset_graph", "seed_graph", "subgraph", "traverse"]

_DATAPIPE_TYPES = (IterDataPipe, MapDataPipe)

#: Types whose pickled form holds data only: a DataPipe cannot hide in one.
_DATA_TYPES = (torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.TypedStorage)


def _holds_data_only(value: Any) -> bool:
    if type(value) in _DATA_TYPES:
        return True
    numpy = sys.modules.get("numpy")  # (an array exists only if numpy was imported)
    return numpy is not None and type(value) is numpy.ndarray and not value.dtype.hasobject


def _stub() -> None:
    return None


class _Sink:
    """A file that keeps nothing: only what the pickler meets matters, not what it writes."""

    def write(self, data: bytes) -> int:
        return len(data)


class _InputFinder:
    """Pickles ``scanned`` to find the DataPipes it holds, as ``traverse_dps`` does: each one not in
    ``seen`` (the path from the output, and those found so far) is recorded and not pickled
    further; one in ``seen`` is pickled through. Only DataPipes, and collections, of a DataPipe's
    attributes are looked into (torch's ``getstate_hook``)."""

    def __init__(self, scanned: DataPipe, seen: Set[int]) -> None:
        self.scanned, self.seen = scanned, seen
        self.found: List[DataPipe] = []

    def reducer_override(self, value: Any) -> Any:
        if isinstance(value, _DATAPIPE_TYPES):
            if value is self.scanned or id(value) in self.seen:
                return NotImplemented
            self.seen.add(id(value))
            self.found.append(value)
            return _stub, ()
        if _holds_data_only(value):
            return _stub, ()
        return NotImplemented

    def inputs(self) -> List[DataPipe]:
        IterDataPipe.set_getstate_hook(_datapipes_and_collections)
        MapDataPipe.set_getstate_hook(_datapipes_and_collections)
        try:
            try:
                _FindingPickler(self).dump(self.scanned)
            except (pickle.PickleError, AttributeError, TypeError):
                dill = _dill()
                if dill is None:
                    raise
                try:
                    _finding_dill_pickler(dill.Pickler)(self).dump(self.scanned)
                finally:
                    dill.extend(False)  # creating its pickler extended pickle's dispatch table
        finally:
            IterDataPipe.set_getstate_hook(None)
            MapDataPipe.set_getstate_hook(None)
        return self.found


class _Finding:
    """What an :class:`_InputFinder`'s pickler adds to pickle's (or dill's): its reductions, and a
    file that keeps nothing."""

    def __init__(self, finder: _InputFinder) -> None:
        super().__init__(_Sink(), protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[call-arg, unused-ignore]
        self.finder = finder

    def reducer_override(self, value: Any) -> Any:
        return self.finder.reducer_override(value)


class _FindingPickler(_Finding, pickle.Pickler):
    pass


@functools.cache
def _finding_dill_pickler(base: type) -> Callable[[_InputFinder], Any]:
    """dill's pickler with the finder's reductions (made once: a class made per traversal is
    garbage the collector must find, in every process, at every epoch)."""

    class FindingDillPickler(_Finding, base):  # type: ignore[misc, valid-type, unused-ignore]
        pass

    return FindingDillPickler


def _dill() -> Any:
    try:
        import dill
    except ImportError:
        return None
    return dill


def _is_looked_into(value: Any) -> bool:
    return isinstance(value, (*_DATAPIPE_TYPES, Collection))


def _datapipes_and_collections(state: Any) -> Any:
    """torch's ``getstate_hook`` while it traverses: of a DataPipe's state, only its DataPipes and
    collections (where inputs are kept), whatever else it holds (functions, handles)."""
    if isinstance(state, dict):
        return {key: value for key, value in state.items() if _is_looked_into(value)}
    if isinstance(state, (tuple, list)):
        return [value for value in state if _is_looked_into(value)]
    return state if _is_looked_into(state) else None


def traverse(datapipe: DataPipe) -> DataPipeGraph:
    """The graph ending at ``datapipe``, as torchdata's ``traverse_dps`` returns it (each DataPipe's
    id, the DataPipe and the graph of its inputs; a DataPipe reached by two paths is in both), found
    without pickling tensors and numeric arrays (see the module's docstring)."""
    return _traverse(datapipe, set())


def _traverse(datapipe: DataPipe, path: Set[int]) -> DataPipeGraph:
    if not isinstance(datapipe, _DATAPIPE_TYPES):
        raise RuntimeError(f"Expected `IterDataPipe` or `MapDataPipe`, but {type(datapipe)} is found")
    if id(datapipe) in path:
        return {}
    path = path | {id(datapipe)}
    inputs: DataPipeGraph = {}
    for found in _InputFinder(datapipe, set(path)).inputs():
        inputs.update(_traverse(found, path))
    return {id(datapipe): (datapipe, inputs)}


def subgraph(graph: DataPipeGraph, datapipe: DataPipe) -> DataPipeGraph:
    """The part of ``graph`` ending at ``datapipe`` (empty if it is not in it), without traversing
    again."""
    pending = deque([graph])
    while pending:
        level = pending.popleft()
        if id(datapipe) in level:
            return {id(datapipe): level[id(datapipe)]}
        pending.extend(inputs for _, inputs in level.values())
    return {}


def replace(graph: DataPipeGraph, old: DataPipe, new: DataPipe) -> DataPipeGraph:
    """torchdata's ``replace_dp``: ``new`` takes ``old``'s place wherever ``graph``'s DataPipes
    hold it (or is the output, if ``old`` was); returns the graph it makes."""
    if id(old) in graph:
        graph = traverse(new)
    ((output, inputs),) = graph.values()
    replace_in_inputs(output, inputs, old, new)
    return traverse(output)


def datapipes_in(graph: DataPipeGraph, excluding: Sequence[DataPipe] = ()) -> List[DataPipe]:
    """``list_dps(graph, exclude_dps=excluding)`` (every DataPipe once, output first, breadth-first;
    the excluded ones and their inputs left out) on this graph alone."""
    excluded: Set[int] = set()
    for dp in excluding:
        excluded.update(id(inner) for inner in list_dps(subgraph(graph, dp)))
    return [dp for dp in list_dps(graph) if id(dp) not in excluded]


def seed_graph(graph: DataPipeGraph, seed_generator: SeedGenerator) -> None:
    """torchdata's ``set_graph_random_seed`` on ``graph``: the random DataPipes up to a sharding
    filter get the generator's shared seeds (the same in every process), the others its own."""
    filters = find_dps(graph, ShardingFilterIterDataPipe)
    before: Dict[int, DataPipe] = {}
    for sf in filters:
        for dp in list_dps(subgraph(graph, sf)):
            before.setdefault(id(dp), dp)
    set_datapipes_seed(list(before.values()), seed_generator, distributed_shared=True)
    set_datapipes_seed(datapipes_in(graph, filters), seed_generator, distributed_shared=False)


ResetFn = Callable[[DataPipe], DataPipe]
CustomResetFn = Callable[[DataPipe, "WorkerInfo", SeedGenerator], DataPipe]


def reset_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    seed_generator: SeedGenerator,
    distributed_shared_seed: bool = False,
    iter_reset_fn: Optional[ResetFn] = None,
    custom_reset_fn: Optional[CustomResetFn] = None,
    graph: Optional[DataPipeGraph] = None,
) -> Tuple[DataPipe, DataPipeGraph]:
    """torchdata's ``process_reset_fn``: the process's global RNGs, then the graph's DataPipes,
    seeded from ``seed_generator``, then the reset functions applied. Returns the DataPipe and its
    graph (``graph``, the one it had, when no reset function ran), for the callers that walk it."""
    # (imported here: torchdata's utils package imports the reading service, which imports this)
    from torchdata.dataloader2.utils.worker import _set_global_random_state

    _set_global_random_state(seed_generator, distributed_shared=distributed_shared_seed)
    graph = traverse(datapipe) if graph is None else graph
    if distributed_shared_seed:
        set_datapipes_seed(list_dps(graph), seed_generator, distributed_shared=True)
    else:
        seed_graph(graph, seed_generator)
    if iter_reset_fn is not None:
        datapipe = _returned_datapipe(iter_reset_fn(datapipe), "iter_reset_fn")
    if custom_reset_fn is not None:
        datapipe = _returned_datapipe(
            custom_reset_fn(datapipe, worker_info, seed_generator), "worker_reset_fn"
        )
    if iter_reset_fn is not None or custom_reset_fn is not None:
        graph = traverse(datapipe)  # (they may have replaced DataPipes)
    return datapipe, graph


def _returned_datapipe(value: Any, name: str) -> DataPipe:
    if not isinstance(value, _DATAPIPE_TYPES):
        raise TypeError(f"{name} returned {type(value).__name__}, not a DataPipe")
    return value
