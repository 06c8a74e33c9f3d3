"""Stateful restore: resume a worker's graph from captured DataPipe states instead of replaying it.

Replay costs as much as re-reading the items the user already received this epoch. When every
DataPipe of a worker's graph can report its state and resume from it, the worker instead
captures its graph's state as often as 1% of its production time allows, at most every
``state_interval`` items (the states travel to the main process with the data), and a restore
loads the latest one at or before the user's position, then replays only the few items after
it: restore time does not depend on the position.

A DataPipe is resumable when, at a moment the graph's output has just yielded (every generator
of a pull-based graph is then suspended at its own ``yield``), its future output is determined
by its sources' future output plus a small state:

* stateless at yield points (resume by iterating afresh over resumed sources): ``Mapper``,
  ``Collator``, ``Filter``, ``Batcher``, ``Zipper`` (functions are assumed to be pure);
* ``ShardingFilter``: stays in place (``DataLoader2`` finds it by its exact type when seeding);
  its state is how many items it yielded, from which follows how many it took from its source;
  a resumed epoch shifts its ``instance_id`` accordingly;
* upstream DataPipes whose state lives in generator frames are replaced, in the worker, by
  equivalents from this module that keep it in attributes (``ADAPTERS``): ``IterableWrapper``
  (over a sequence or range), ``Shuffler`` (buffer and RNG), ``UnBatcher``, ``Header``,
  ``Cycler``, ``Concater``, ``Multiplexer``, ``FileLister``; they yield exactly what the
  originals yield, epoch after epoch;
* any DataPipe with ``state_dict()`` and ``load_state_dict(state)`` methods, or whose type was
  registered with :func:`~torchdata_snapshot.register_state_functions`. ``load_state_dict`` is
  called before the resumed epoch's iterator starts; the next iteration must continue from that
  state.

The worker's global ``random``/``torch``/``numpy`` states are part of the captured state, so
map functions drawing from them resume exactly too.

A captured state describes the iterations in progress at that moment, and only DataPipes that
started an iteration in the current epoch (or in the current pass of an enclosing ``cycle()``)
are captured. Once the run moves past those iterations (a new epoch, a new pass of ``cycle()``)
whatever was loaded into the DataPipes below is forgotten, so that they start afresh
(``forget_loaded_states``).
"""

from __future__ import annotations

import copy
import functools
import pickle
import random
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.callable import CollatorIterDataPipe, MapperIterDataPipe
from torch.utils.data.datapipes.iter.combinatorics import ShufflerIterDataPipe
from torch.utils.data.datapipes.iter.combining import (
    ConcaterIterDataPipe,
    MultiplexerIterDataPipe,
    ZipperIterDataPipe,
)
from torch.utils.data.datapipes.iter.filelister import FileListerIterDataPipe
from torch.utils.data.datapipes.iter.grouping import BatcherIterDataPipe, UnBatcherIterDataPipe
from torch.utils.data.datapipes.iter.selecting import FilterIterDataPipe
from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe
from torchdata.dataloader2.graph import DataPipe, replace_dp, traverse_dps
from torchdata.datapipes.iter import Cycler as CyclerIterDataPipe
from torchdata.datapipes.iter import FlatMapper as FlatMapperIterDataPipe
from torchdata.datapipes.iter import Header as HeaderIterDataPipe

from torchdata_snapshot._compat import (
    flatmap_expand,
    get_file_pathnames_from_root,
    iterator_id,
    samples_yielded,
    shuffler_settings,
    unbatch_dive,
)
from torchdata_snapshot._errors import StateCaptureError, StateRestoreError
from torchdata_snapshot._graph import datapipe_state_dicts, describe_datapipe, graph_datapipes
from torchdata_snapshot._rng import (
    check_global_rng_state,
    packed_global_rng_state,
    set_global_rng_state,
    unpack_global_rng_state,
    unpack_python_state,
)
from torchdata_snapshot._rng_memory import packed_random_state

__all__ = [
    "ADAPTERS",
    "STATELESS",
    "Resumable",
    "StateFunctionTable",
    "capture_graph_state",
    "check_state_functions_pickle",
    "forget_loaded_states",
    "graph_state_functions",
    "load_datapipe_states",
    "load_graph_state",
    "make_resumable",
    "register_state_functions",
    "reset_graph_state",
    "sharding_taken",
    "sharding_taken_before",
    "unpack_graph_state",
    "unresumable_datapipe",
    "use_state_functions",
]

_RNG_KEY = "__global_rng__"


def _expect(state: Any, owner: str, **fields: Any) -> Dict[str, Any]:
    """``state`` if it is a dict with exactly ``fields`` (name -> type, or tuple of types; ints
    must be non-negative), else ``ValueError`` naming what is wrong: a state is checked when it is
    loaded, not when a corrupted one would fail halfway through an iteration."""
    if not isinstance(state, dict) or set(state) != set(fields):
        raise ValueError(f"the state of {owner} must have the fields {sorted(fields)}, got {state!r:.200}")
    for name, kind in fields.items():
        value = state[name]
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            raise ValueError(f"the state of {owner}: {name!r} is not a valid {kind}: {value!r:.200}")
    return state


class Resumable(IterDataPipe):
    """Base of the equivalents in this module: ``state_dict()`` describes the DataPipe at a yield
    point; a state given to ``load_state_dict()`` is checked against ``STATE`` (field -> type)
    and used by the next iteration, once."""

    STATE: Dict[str, Any] = {}
    _pending: Optional[Dict[str, Any]] = None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._pending = self._check_state(_expect(state, type(self).__name__, **self.STATE))

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """Checks beyond the fields' types (a subclass's); the state, unchanged."""
        return state

    def _take_pending(self) -> Optional[Dict[str, Any]]:
        state, self._pending = self._pending, None
        return state

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError


class ResumableIterableWrapper(Resumable):
    """``IterableWrapper`` over a sequence: its state is the position in it (where this iteration
    started plus what torch's iterator hook counted since, so no per-item bookkeeping). A
    resumed iteration starts at the position by indexing, in constant time."""

    STATE = {"position": int}

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        if state["position"] > len(self.iterable):
            raise ValueError(f"position {state['position']} is past the end ({len(self.iterable)} items)")
        return state

    def __init__(self, iterable: Sequence, deepcopy: bool = True) -> None:
        self.iterable = iterable
        self.deepcopy = deepcopy
        self._start = 0

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        source = self.iterable
        if self.deepcopy:
            try:
                source = copy.deepcopy(self.iterable)
            except TypeError:
                warnings.warn(
                    "The input iterable can not be deepcopied, "
                    "please be aware of in-place modification would affect source data.",
                    stacklevel=2,
                )
        self._start = state["position"] if state else 0
        # Indexing starts at the position in O(1); islice would walk the skipped items.
        yield from map(source.__getitem__, range(self._start, len(source)))

    def state_dict(self) -> Dict[str, Any]:
        return {"position": self._start + samples_yielded(self)}

    def __len__(self) -> int:
        return len(self.iterable)


class ResumableShuffler(Resumable):
    """``Shuffler`` with the same reservoir sampling and RNG use; its state is buffer and RNG."""

    STATE = {"enabled": bool, "buffer": list, "rng": tuple}

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        random.Random().setstate(unpack_python_state(state["rng"]))  # raises for a state that is not one
        return state

    def __init__(self, datapipe: IterDataPipe, buffer_size: int, enabled: bool, seed: Optional[int]) -> None:
        self.datapipe = datapipe
        self.buffer_size = buffer_size
        self._enabled = enabled
        self._seed = seed
        self._rng = random.Random()
        self._buffer: List[Any] = []

    def set_shuffle(self, shuffle: bool = True) -> ResumableShuffler:
        self._enabled = shuffle
        return self

    def set_seed(self, seed: int) -> ResumableShuffler:
        self._seed = seed
        return self

    def reset(self) -> None:
        self._buffer = []
        if self._enabled:
            if self._seed is None:
                self._seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self._rng.seed(self._seed)
            self._seed = None

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        if state is not None:
            self._enabled = state["enabled"]
            self._buffer = list(state["buffer"])
            self._rng.setstate(unpack_python_state(state["rng"]))
        if not self._enabled:
            yield from self.datapipe
            return
        for x in self.datapipe:
            if len(self._buffer) == self.buffer_size:
                idx = self._rng.randint(0, len(self._buffer) - 1)
                val, self._buffer[idx] = self._buffer[idx], x
                yield val
            else:
                self._buffer.append(x)
        while self._buffer:
            idx = self._rng.randint(0, len(self._buffer) - 1)
            yield self._buffer.pop(idx)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "enabled": self._enabled,
            "buffer": list(self._buffer),
            "rng": packed_random_state(self._rng),
        }

    def __len__(self) -> int:
        return len(self.datapipe)


class _Expanding(Resumable):
    """A one-to-many DataPipe: each source element expands into items; its state is what is left
    of the current element's expansion (which therefore is materialized when it starts)."""

    STATE = {"items": list}

    datapipe: IterDataPipe
    _items: Deque[Any] = deque()

    def _expand(self, element: Any) -> Iterable[Any]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._items = deque(state["items"]) if state else deque()
        while self._items:
            yield self._items.popleft()
        for element in self.datapipe:
            self._items = deque(self._expand(element))
            while self._items:
                yield self._items.popleft()

    def state_dict(self) -> Dict[str, Any]:
        return {"items": list(self._items)}


class ResumableUnBatcher(_Expanding):
    """``UnBatcher``, through upstream's own expansion."""

    _dive = unbatch_dive

    def __init__(self, datapipe: IterDataPipe, unbatch_level: int) -> None:
        self.datapipe = datapipe
        self.unbatch_level = unbatch_level
        self._items = deque()

    def _expand(self, element: Any) -> Iterable[Any]:
        return self._dive(element, unbatch_level=self.unbatch_level)


class ResumableFlatMapper(_Expanding):
    """``FlatMapper``: the function is applied through the original DataPipe's ``_apply_fn``
    (``input_col`` handling included)."""

    def __init__(self, upstream: Any) -> None:
        self.datapipe = upstream.datapipe
        self.fn = upstream.fn
        self.input_col = upstream.input_col
        self._upstream_apply = flatmap_expand(upstream)
        self._items = deque()

    def _expand(self, element: Any) -> Iterable[Any]:
        return self._upstream_apply(self, element)


class ResumableHeader(Resumable):
    """``Header``: its state is how many items it took."""

    STATE = {"taken": int}

    def __init__(self, source_datapipe: IterDataPipe, limit: Optional[int]) -> None:
        self.source_datapipe = source_datapipe
        self.limit = limit
        self._taken = 0

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._taken = state["taken"] if state else 0
        for value in self.source_datapipe:
            self._taken += 1
            if self.limit is None or self._taken <= self.limit:
                yield value
            else:
                break

    def state_dict(self) -> Dict[str, Any]:
        return {"taken": self._taken}


class ResumableCycler(Resumable):
    """``Cycler``: its state is the cycle in progress (the source holds its own position).

    A loaded state belongs to the pass in progress when it was captured: every later pass
    iterates the source afresh, so the states loaded into the source's subgraph are forgotten
    before it starts (see :func:`forget_loaded_states`).
    """

    STATE = {"cycle": int}

    def __init__(self, source_datapipe: IterDataPipe, count: Optional[int]) -> None:
        self.source_datapipe = source_datapipe
        self.count = count
        self._cycle = 0

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._cycle = state["cycle"] if state else 0
        first_pass = True
        while self.count is None or self._cycle < self.count:
            if not first_pass:
                forget_loaded_states(self._source_subgraph())
            first_pass = False
            yield from self.source_datapipe
            self._cycle += 1

    def _source_subgraph(self) -> List[DataPipe]:
        # Kept outside the instance, so that graph traversal (which pickles DataPipes) does not
        # take the cached DataPipes for parents; the adapted graph does not change afterwards.
        subgraph = _SUBGRAPHS.get(self)
        if subgraph is None:
            subgraph = _SUBGRAPHS[self] = [dp for _, dp in graph_datapipes(self.source_datapipe)]
        return subgraph

    def state_dict(self) -> Dict[str, Any]:
        return {"cycle": self._cycle}


#: ``ResumableCycler`` -> the DataPipes of its source's subgraph (looked up once).
_SUBGRAPHS: weakref.WeakKeyDictionary[ResumableCycler, List[DataPipe]] = weakref.WeakKeyDictionary()


class ResumableConcater(Resumable):
    """``Concater``: its state is the source in progress."""

    STATE = {"index": int}

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        if state["index"] > len(self.datapipes):
            raise ValueError(f"source {state['index']} of {len(self.datapipes)} does not exist")
        return state

    def __init__(self, *datapipes: IterDataPipe) -> None:
        self.datapipes = datapipes
        self._index = 0

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._index = state["index"] if state else 0
        while self._index < len(self.datapipes):
            yield from self.datapipes[self._index]
            self._index += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"index": self._index}


class ResumableMultiplexer(Resumable):
    """``Multiplexer`` (one item from each source per round, until one is exhausted): its state is
    what is left of the round in progress."""

    STATE = {"round": list}

    def __init__(self, *datapipes: IterDataPipe) -> None:
        self.datapipes = datapipes
        self._round: Deque[Any] = deque()

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._round = deque(state["round"]) if state else deque()
        iterators = [iter(x) for x in self.datapipes]
        while self._round:
            yield self._round.popleft()
        while iterators:
            taken = []
            for it in iterators:
                try:
                    taken.append(next(it))
                except StopIteration:
                    return
            self._round = deque(taken)
            while self._round:
                yield self._round.popleft()

    def state_dict(self) -> Dict[str, Any]:
        return {"round": list(self._round)}


class ResumableFileLister(Resumable):
    """``FileLister``: its state is the root being listed and how many of its files were yielded
    (the listing is recomputed on restore, not stored)."""

    STATE = {"root": (str, type(None)), "yielded": int}

    def __init__(self, upstream: FileListerIterDataPipe) -> None:
        self.datapipe = upstream.datapipe
        self.masks = upstream.masks
        self.recursive = upstream.recursive
        self.abspath = upstream.abspath
        self.non_deterministic = upstream.non_deterministic
        self._root: Optional[str] = None
        self._yielded = 0

    def _list(self, root: str) -> Iterable[str]:
        return get_file_pathnames_from_root(
            root, self.masks, self.recursive, self.abspath, self.non_deterministic
        )

    def __iter__(self) -> Iterator[str]:
        state = self._take_pending()
        self._root, self._yielded = None, 0
        if state and state["root"] is not None:
            self._root, skip = state["root"], state["yielded"]
            for i, path in enumerate(self._list(self._root)):
                if i >= skip:
                    self._yielded = i + 1
                    yield path
        for root in self.datapipe:
            self._root, self._yielded = root, 0
            for path in self._list(root):
                self._yielded += 1
                yield path

    def state_dict(self) -> Dict[str, Any]:
        return {"root": self._root, "yielded": self._yielded}


#: Upstream ``ShardingFilter`` -> ``(instance_id to restore at the next epoch, items it yielded
#: before the current iteration started)`` while a resumed epoch runs with a shifted id.
_SHIFTED: weakref.WeakKeyDictionary[ShardingFilterIterDataPipe, Tuple[int, int]] = weakref.WeakKeyDictionary()


def sharding_taken(sf: ShardingFilterIterDataPipe) -> int:
    """How many items the filter yielded this epoch (torch's iterator hook counts them), also
    across a resume from a loaded state."""
    return sharding_taken_before(sf) + samples_yielded(sf)


def sharding_taken_before(sf: ShardingFilterIterDataPipe) -> int:
    """How many items the filter yielded this epoch before its current iteration started (those
    of a loaded state): :func:`sharding_taken` minus what torch's hook counts."""
    shifted = _SHIFTED.get(sf)
    return shifted[1] if shifted is not None else 0


def _sharding_state(sf: ShardingFilterIterDataPipe) -> Dict[str, Any]:
    return {"yielded": sharding_taken(sf)}


def _sharding_load(sf: ShardingFilterIterDataPipe, state: Dict[str, Any]) -> None:
    """Resume the filter over a source resumed where it stood.

    Suspended right after its ``j``-th item, the filter had taken ``i + 1`` items from its source,
    where ``i = instance_id + (j - 1) * num_of_instances`` is the index of that item. A fresh
    enumeration over the resumed source must therefore pick the indices ``k`` with
    ``(k + i + 1) % n == instance_id``, i.e. ``k % n == n - 1``.
    """
    yielded = _expect(state, "ShardingFilter", yielded=int)["yielded"]
    original = _SHIFTED[sf][0] if sf in _SHIFTED else sf.instance_id
    _SHIFTED[sf] = (original, yielded)
    if yielded:
        consumed = original + (yielded - 1) * sf.num_of_instances + 1
        sf.instance_id = (original - consumed) % sf.num_of_instances


def _sharding_reset(sf: ShardingFilterIterDataPipe) -> None:
    """Back to the original ``instance_id``, for an iteration that starts afresh."""
    if sf in _SHIFTED:
        sf.instance_id = _SHIFTED.pop(sf)[0]


def _adapt_iterable_wrapper(dp: IterableWrapperIterDataPipe) -> Optional[IterDataPipe]:
    iterable = dp.iterable
    if isinstance(iterable, (Sequence, range)) and not isinstance(iterable, (str, bytes)):
        return ResumableIterableWrapper(iterable, dp.deepcopy)
    return None


#: Upstream DataPipe type -> a function building its resumable equivalent (or ``None`` when
#: this instance cannot resume, e.g. an ``IterableWrapper`` over a generator).
ADAPTERS: Dict[type, Callable[[Any], Optional[IterDataPipe]]] = {
    IterableWrapperIterDataPipe: _adapt_iterable_wrapper,
    ShufflerIterDataPipe: lambda dp: ResumableShuffler(dp.datapipe, dp.buffer_size, *shuffler_settings(dp)),
    UnBatcherIterDataPipe: lambda dp: ResumableUnBatcher(dp.datapipe, dp.unbatch_level),
    FlatMapperIterDataPipe: ResumableFlatMapper,
    HeaderIterDataPipe: lambda dp: ResumableHeader(dp.source_datapipe, dp.limit),
    CyclerIterDataPipe: lambda dp: ResumableCycler(dp.source_datapipe, dp.count),
    ConcaterIterDataPipe: lambda dp: ResumableConcater(*dp.datapipes),
    MultiplexerIterDataPipe: lambda dp: ResumableMultiplexer(*dp.datapipes),
    FileListerIterDataPipe: ResumableFileLister,
}

#: Upstream DataPipe types that hold no state at a yield point.
STATELESS = (
    MapperIterDataPipe,
    CollatorIterDataPipe,
    FilterIterDataPipe,
    BatcherIterDataPipe,
    ZipperIterDataPipe,
)

#: DataPipe type -> ``(state_dict, load_state_dict)`` functions (see :func:`register_state_functions`).
StateFunctionTable = Dict[type, Tuple[Callable[[Any], Any], Callable[[Any, Any], None]]]

_STATE_FUNCTIONS: StateFunctionTable = {
    ShardingFilterIterDataPipe: (_sharding_state, _sharding_load),
}


def register_state_functions(
    datapipe_type: type, state_dict: Callable[[Any], Any], load_state_dict: Callable[[Any, Any], None]
) -> None:
    """Make DataPipes of ``datapipe_type`` resumable without changing the class.

    ``state_dict(dp)`` returns a picklable state at a yield point; ``load_state_dict(dp, state)``
    prepares ``dp`` so that its next iteration continues from that state.

    The registrations of the graph's DataPipe types are sent to the worker processes when they
    start, also under ``spawn`` and ``forkserver``, whose workers do not run the code that made
    them (a script's ``main()``). There the functions travel pickled, by reference: they must be
    defined at module level (a lambda or a nested function is refused with
    :class:`~torchdata_snapshot.StateCaptureError` when the workers start).
    """
    _STATE_FUNCTIONS[datapipe_type] = (state_dict, load_state_dict)


def graph_state_functions(datapipe: DataPipe) -> StateFunctionTable:
    """The state functions of the graph's DataPipe types, to send to the worker processes that
    run it (:func:`use_state_functions`)."""
    kinds = {type(dp) for _, dp in graph_datapipes(datapipe)}
    return {kind: functions for kind, functions in _STATE_FUNCTIONS.items() if kind in kinds}


def check_state_functions_pickle(table: StateFunctionTable, start_method: str) -> None:
    """Raise :class:`StateCaptureError` naming a DataPipe type whose state function does not
    pickle: workers started by ``start_method`` could not receive it."""
    for kind, functions in table.items():
        for function in functions:
            try:
                pickle.dumps(function, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                name = f"{kind.__module__}.{kind.__qualname__}"
                raise StateCaptureError(
                    f"the state function {function!r} registered for {name} cannot be "
                    f"sent to worker processes started by {start_method!r} ({type(e).__name__}: {e}): "
                    "define it at module level, or use multiprocessing_context='fork'"
                ) from e


def use_state_functions(table: StateFunctionTable) -> None:
    """Register ``table`` in this (worker) process (see :func:`graph_state_functions`)."""
    _STATE_FUNCTIONS.update(table)


def _has_methods(dp: DataPipe) -> bool:
    return callable(getattr(dp, "state_dict", None)) and callable(getattr(dp, "load_state_dict", None))


def unresumable_datapipe(datapipe: DataPipe) -> Optional[str]:
    """``None`` if the graph can resume from captured states, else the first DataPipe that cannot."""
    for _, dp in graph_datapipes(datapipe):
        kind = type(dp)
        if (
            kind in STATELESS
            or kind is ShardingFilterIterDataPipe
            or kind in _STATE_FUNCTIONS
            or _has_methods(dp)
        ):
            continue
        adapter = ADAPTERS.get(kind)
        if adapter is None or adapter(dp) is None:
            return describe_datapipe(dp)
    return None


def make_resumable(datapipe: DataPipe) -> DataPipe:
    """Rewrite a resumable graph (see :func:`unresumable_datapipe`): replace upstream DataPipes by
    their equivalents. ``ShardingFilter`` stays: ``DataLoader2`` finds it by its exact type."""
    graph = traverse_dps(datapipe)
    for _, dp in graph_datapipes(datapipe):
        adapter = ADAPTERS.get(type(dp))
        if adapter is not None and not _has_methods(dp):
            replacement = adapter(dp)
            if replacement is not None:
                graph = replace_dp(graph, dp, replacement)
    return next(iter(graph.values()))[0]


def capture_graph_state(graph: List[Tuple[str, DataPipe]]) -> bytes:
    """The state of every stateful DataPipe of ``graph`` (and the global RNGs), pickled.

    Raises :class:`StateCaptureError` naming the DataPipe whose state fails or does not pickle.
    """
    states: Dict[str, Any] = {_RNG_KEY: packed_global_rng_state()}
    for key, dp in graph:
        if not _started_since_forgotten(dp):
            continue  # not started in this epoch (or pass): it will start afresh after a restore too
        functions = _STATE_FUNCTIONS.get(type(dp))
        try:
            if functions is not None:
                states[key] = functions[0](dp)
            elif _has_methods(dp):
                states[key] = dp.state_dict()
        except Exception as e:
            raise StateCaptureError(
                f"state_dict() of DataPipe {key} ({describe_datapipe(dp)}) raised {type(e).__name__}: {e}"
            ) from e
    try:
        return pickle.dumps(states, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        datapipe_state_dicts(graph)  # names the DataPipe and attribute that do not pickle
        raise StateCaptureError(f"the graph's state cannot be pickled: {type(e).__name__}: {e}") from e


def load_graph_state(graph: List[Tuple[str, DataPipe]], blob: bytes) -> None:
    """Load a :func:`capture_graph_state` blob into ``graph`` (same structure) before iterating.

    Raises :class:`StateRestoreError` naming the DataPipe whose ``load_state_dict`` fails, or
    saying that the blob is not such a state (a damaged checkpoint).
    """
    states = unpack_graph_state(blob)
    load_datapipe_states(graph, states)
    set_global_rng_state(states[_RNG_KEY])


def unpack_graph_state(blob: bytes) -> Dict[str, Any]:
    """A :func:`capture_graph_state` blob as ``{key: state}`` (the global RNGs' checked and
    unpacked), or :class:`StateRestoreError` saying that it is not such a state."""
    try:
        states = pickle.loads(blob)
        if not isinstance(states, dict) or _RNG_KEY not in states:
            raise ValueError(f"it unpickles to {type(states).__name__}, not the state of a graph")
        states[_RNG_KEY] = unpack_global_rng_state(states[_RNG_KEY])
        check_global_rng_state(states[_RNG_KEY])
    except Exception as e:
        raise StateRestoreError(f"the worker's graph state cannot be loaded: {type(e).__name__}: {e}") from e
    return states


def load_datapipe_states(graph: List[Tuple[str, DataPipe]], states: Dict[str, Any]) -> None:
    """Load ``states[key]`` into each DataPipe of ``graph`` that has one (the global RNGs are
    left alone); raises :class:`StateRestoreError` naming a DataPipe whose load fails."""
    for key, dp in graph:
        if key not in states:
            continue
        functions = _STATE_FUNCTIONS.get(type(dp))
        try:
            if functions is not None:
                functions[1](dp, states[key])
            else:
                dp.load_state_dict(states[key])
        except Exception as e:
            what = f"load_state_dict() of DataPipe {key} ({describe_datapipe(dp)})"
            raise StateRestoreError(f"{what} raised {type(e).__name__}: {e}") from e


def forget_loaded_states(datapipes: Iterable[DataPipe]) -> None:
    """The next iteration of each of ``datapipes`` starts afresh, not from a loaded state.

    A state captured after an item describes the iterations in progress at that moment; once
    the run moves past them (a new epoch, a new pass of ``cycle()`` over the subgraph), a state
    loaded but not consumed yet (a source of ``zip`` that was never advanced again) or already
    applied (a sharding filter's shifted ``instance_id``) must not carry into the next
    iteration, and DataPipes that have not started again are no longer captured.
    """
    for dp in datapipes:
        key = id(dp)
        _FORGOTTEN[key] = (weakref.ref(dp, functools.partial(_forget_entry, key)), iterator_id(dp))
        if isinstance(dp, Resumable):
            dp._pending = None
        if type(dp) is ShardingFilterIterDataPipe:
            _sharding_reset(dp)


#: ``id(dp)`` -> ``(weakref to dp, dp's iterator id when its states were last forgotten)``. Torch
#: numbers a DataPipe's iterators as they start (``_valid_iterator_id``), so a DataPipe whose
#: number has not moved since has not started again: its state is not captured. Keyed by id, as
#: DataPipes need not be hashable.
_FORGOTTEN: Dict[int, Tuple[Any, Optional[int]]] = {}


def _forget_entry(key: int, _: Any) -> None:
    _FORGOTTEN.pop(key, None)


def _started_since_forgotten(dp: DataPipe) -> bool:
    entry = _FORGOTTEN.get(id(dp))
    return entry is None or entry[0]() is not dp or iterator_id(dp) != entry[1]


def reset_graph_state(graph: List[Tuple[str, DataPipe]]) -> None:
    """A new epoch: every DataPipe of the graph starts afresh (see :func:`forget_loaded_states`)."""
    forget_loaded_states(dp for _, dp in graph)
