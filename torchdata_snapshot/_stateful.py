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
(``GraphState.forget``).

Each worker keeps this bookkeeping in the ``GraphState`` of its graph, created with the
registered state functions the main process sent it: a worker started by ``spawn`` or
``forkserver`` does not run the code that registered them.
"""

from __future__ import annotations

import copy
import pickle
import random
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
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
    "GraphState",
    "Resumable",
    "ShardingShifts",
    "StateFunctions",
    "check_state_functions_pickle",
    "graph_state_functions",
    "register_state_functions",
    "registered_state_functions",
    "unpack_graph_state",
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

    def discard_loaded_state(self) -> None:
        """The next iteration starts afresh, not from a state loaded and not used yet."""
        self._pending = None

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
    iterates the source afresh, so ``on_new_pass`` forgets the states loaded into the source's
    subgraph before it starts (:meth:`GraphState.make_resumable` sets it).
    """

    STATE = {"cycle": int}

    def __init__(self, source_datapipe: IterDataPipe, count: Optional[int]) -> None:
        self.source_datapipe = source_datapipe
        self.count = count
        self._cycle = 0
        # A function, neither a DataPipe nor a collection: graph traversal (which pickles
        # DataPipes) does not take the DataPipes it refers to for sources.
        self.on_new_pass: Callable[[], None] = _nothing_loaded

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._cycle = state["cycle"] if state else 0
        first_pass = True
        while self.count is None or self._cycle < self.count:
            if not first_pass:
                self.on_new_pass()
            first_pass = False
            yield from self.source_datapipe
            self._cycle += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"cycle": self._cycle}


def _nothing_loaded() -> None:
    """``ResumableCycler.on_new_pass`` outside a :class:`GraphState`: no state was loaded."""


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


class ShardingShifts:
    """The state functions of upstream's ``ShardingFilter``, which stays in a resumable graph
    (``DataLoader2`` finds it by its exact type when seeding), for the filters of one graph.

    A filter's state is how many items it yielded this epoch. Resumed from one, it runs with a
    shifted ``instance_id`` until the next fresh iteration (:meth:`reset`), and counts the items
    it yielded before the current iteration started (:meth:`taken_before`).
    """

    def __init__(self) -> None:
        #: ``id(sf)`` -> ``(sf, its instance_id before a loaded state shifted it, the items it
        #: yielded before the current iteration started)``, while a resumed epoch runs. The entry
        #: holds ``sf``: its id cannot be reused meanwhile (DataPipes need not be hashable).
        self._shifted: Dict[int, Tuple[ShardingFilterIterDataPipe, int, int]] = {}

    def taken(self, sf: ShardingFilterIterDataPipe) -> int:
        """How many items the filter yielded this epoch (torch's iterator hook counts them), also
        across a resume from a loaded state."""
        return self.taken_before(sf) + samples_yielded(sf)

    def taken_before(self, sf: ShardingFilterIterDataPipe) -> int:
        """How many items the filter yielded this epoch before its current iteration started (those
        of a loaded state): :meth:`taken` minus what torch's hook counts."""
        shifted = self._shifted.get(id(sf))
        return shifted[2] if shifted is not None else 0

    def state_dict(self, sf: ShardingFilterIterDataPipe) -> Dict[str, Any]:
        return {"yielded": self.taken(sf)}

    def load_state_dict(self, sf: ShardingFilterIterDataPipe, state: Dict[str, Any]) -> None:
        """Resume the filter over a source resumed where it stood.

        Suspended right after its ``j``-th item, the filter had taken ``i + 1`` items from its
        source, where ``i = instance_id + (j - 1) * num_of_instances`` is the index of that item. A
        fresh enumeration over the resumed source must therefore pick the indices ``k`` with
        ``(k + i + 1) % n == instance_id``, i.e. ``k % n == n - 1``.
        """
        yielded = _expect(state, "ShardingFilter", yielded=int)["yielded"]
        shifted = self._shifted.get(id(sf))
        original = shifted[1] if shifted is not None else sf.instance_id
        self._shifted[id(sf)] = (sf, original, yielded)
        if yielded:
            consumed = original + (yielded - 1) * sf.num_of_instances + 1
            sf.instance_id = (original - consumed) % sf.num_of_instances

    def reset(self, sf: ShardingFilterIterDataPipe) -> None:
        """Back to the original ``instance_id``, for an iteration that starts afresh."""
        shifted = self._shifted.pop(id(sf), None)
        if shifted is not None:
            sf.instance_id = shifted[1]


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

#: The class attribute in which :func:`register_state_functions` records the functions: a
#: :class:`StateFunctions` naming the class it was made for, so that a subclass, which inherits
#: the attribute, is not taken as registered.
_REGISTERED = "_torchdata_snapshot_state_functions"


@dataclass(frozen=True)
class StateFunctions:
    """The functions :func:`register_state_functions` recorded for DataPipes of exactly
    ``datapipe_type``."""

    datapipe_type: type
    state_dict: Callable[[Any], Any]
    load_state_dict: Callable[[Any, Any], None]


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
    setattr(datapipe_type, _REGISTERED, StateFunctions(datapipe_type, state_dict, load_state_dict))


def registered_state_functions(datapipe_type: type) -> Optional[StateFunctions]:
    """What :func:`register_state_functions` recorded in this process for exactly ``datapipe_type``."""
    found = getattr(datapipe_type, _REGISTERED, None)
    return found if isinstance(found, StateFunctions) and found.datapipe_type is datapipe_type else None


def graph_state_functions(datapipe: DataPipe) -> Tuple[StateFunctions, ...]:
    """The registered state functions of the graph's DataPipe types, for the worker processes
    that run it (their :class:`GraphState`)."""
    kinds = dict.fromkeys(type(dp) for _, dp in graph_datapipes(datapipe))
    found = (registered_state_functions(kind) for kind in kinds)
    return tuple(functions for functions in found if functions is not None)


def check_state_functions_pickle(carried: Sequence[StateFunctions], start_method: str) -> None:
    """Raise :class:`StateCaptureError` naming a DataPipe type whose state function does not
    pickle: workers started by ``start_method`` could not receive it."""
    for functions in carried:
        for function in (functions.state_dict, functions.load_state_dict):
            try:
                pickle.dumps(function, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                kind = functions.datapipe_type
                raise StateCaptureError(
                    f"the state function {function!r} registered for {kind.__module__}.{kind.__qualname__} "
                    f"cannot be sent to worker processes started by {start_method!r} "
                    f"({type(e).__name__}: {e}): define it at module level, or use "
                    "multiprocessing_context='fork'"
                ) from e


def _has_methods(dp: DataPipe) -> bool:
    return callable(getattr(dp, "state_dict", None)) and callable(getattr(dp, "load_state_dict", None))


#: How a DataPipe's state is taken and loaded: ``(state_dict(dp), load_state_dict(dp, state))``.
_Functions = Tuple[Callable[[Any], Any], Callable[[Any, Any], None]]


class GraphState:
    """The states of one worker's graph: how each DataPipe's state is taken and loaded, and which
    states were forgotten (see :meth:`forget`).

    The worker creates it with the registered state functions it was sent (``carried``, see
    :func:`graph_state_functions`); a type it was not sent uses what was registered in the
    worker's own process. Upstream's ``ShardingFilter`` has built-in ones (:class:`ShardingShifts`).
    """

    def __init__(self, carried: Sequence[StateFunctions] = ()) -> None:
        self._carried = {functions.datapipe_type: functions for functions in carried}
        self.sharding = ShardingShifts()
        #: ``id(dp)`` -> ``(dp, dp's iterator id when its states were last forgotten)``. Torch
        #: numbers a DataPipe's iterators as they start (``_valid_iterator_id``), so a DataPipe
        #: whose number has not moved since has not started again: its state is not captured.
        #: The entry holds ``dp``: its id cannot be reused meanwhile (DataPipes need not be
        #: hashable). Rebuilt at each epoch's :meth:`reset`.
        self._forgotten: Dict[int, Tuple[DataPipe, Optional[int]]] = {}

    def _functions(self, dp: DataPipe) -> Optional[_Functions]:
        kind = type(dp)
        registered = self._carried.get(kind) or registered_state_functions(kind)
        if registered is not None:
            return registered.state_dict, registered.load_state_dict
        if kind is ShardingFilterIterDataPipe:
            return self.sharding.state_dict, self.sharding.load_state_dict
        return None

    # --- the graph rewrite ------------------------------------------------------------------------

    def unresumable(self, datapipe: DataPipe) -> Optional[str]:
        """``None`` if the graph can resume from captured states, else the first DataPipe that cannot."""
        for _, dp in graph_datapipes(datapipe):
            if type(dp) in STATELESS or self._functions(dp) is not None or _has_methods(dp):
                continue
            adapter = ADAPTERS.get(type(dp))
            if adapter is None or adapter(dp) is None:
                return describe_datapipe(dp)
        return None

    def make_resumable(self, datapipe: DataPipe) -> DataPipe:
        """Rewrite a resumable graph (see :meth:`unresumable`): replace upstream DataPipes by
        their equivalents. ``ShardingFilter`` stays: ``DataLoader2`` finds it by its exact type."""
        graph = traverse_dps(datapipe)
        for _, dp in graph_datapipes(datapipe):
            adapter = ADAPTERS.get(type(dp))
            if adapter is not None and not _has_methods(dp):
                replacement = adapter(dp)
                if replacement is not None:
                    graph = replace_dp(graph, dp, replacement)
        resumable = next(iter(graph.values()))[0]
        for _, dp in graph_datapipes(resumable):
            if isinstance(dp, ResumableCycler):
                dp.on_new_pass = self._forgetting_source_of(dp)
        return resumable

    def _forgetting_source_of(self, cycler: ResumableCycler) -> Callable[[], None]:
        """What ``cycler`` does before each pass after the first: forget the states of its
        source's subgraph (looked up at the first such pass)."""
        subgraph: List[DataPipe] = []

        def forget_source() -> None:
            if not subgraph:
                subgraph.extend(dp for _, dp in graph_datapipes(cycler.source_datapipe))
            self.forget(subgraph)

        return forget_source

    # --- capture and load -------------------------------------------------------------------------

    def capture(self, graph: List[Tuple[str, DataPipe]]) -> bytes:
        """The state of every stateful DataPipe of ``graph`` (and the global RNGs), pickled.

        Raises :class:`StateCaptureError` naming the DataPipe whose state fails or does not pickle.
        """
        states: Dict[str, Any] = {_RNG_KEY: packed_global_rng_state()}
        for key, dp in graph:
            if not self._started_since_forgotten(dp):
                continue  # not started in this epoch (or pass): it will start afresh after a restore too
            functions = self._functions(dp)
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

    def load(self, graph: List[Tuple[str, DataPipe]], blob: bytes) -> None:
        """Load a :meth:`capture` blob into ``graph`` (same structure) before iterating.

        Raises :class:`StateRestoreError` naming the DataPipe whose ``load_state_dict`` fails, or
        saying that the blob is not such a state (a damaged checkpoint).
        """
        states = unpack_graph_state(blob)
        self.load_datapipe_states(graph, states)
        set_global_rng_state(states[_RNG_KEY])

    def load_datapipe_states(self, graph: List[Tuple[str, DataPipe]], states: Dict[str, Any]) -> None:
        """Load ``states[key]`` into each DataPipe of ``graph`` that has one (the global RNGs are
        left alone); raises :class:`StateRestoreError` naming a DataPipe whose load fails."""
        for key, dp in graph:
            if key not in states:
                continue
            functions = self._functions(dp)
            try:
                if functions is not None:
                    functions[1](dp, states[key])
                else:
                    dp.load_state_dict(states[key])
            except Exception as e:
                what = f"load_state_dict() of DataPipe {key} ({describe_datapipe(dp)})"
                raise StateRestoreError(f"{what} raised {type(e).__name__}: {e}") from e

    # --- forgetting -------------------------------------------------------------------------------

    def forget(self, datapipes: Iterable[DataPipe]) -> None:
        """The next iteration of each of ``datapipes`` starts afresh, not from a loaded state.

        A state captured after an item describes the iterations in progress at that moment; once
        the run moves past them (a new epoch, a new pass of ``cycle()`` over the subgraph), a state
        loaded but not consumed yet (a source of ``zip`` that was never advanced again) or already
        applied (a sharding filter's shifted ``instance_id``) must not carry into the next
        iteration, and DataPipes that have not started again are no longer captured.
        """
        for dp in datapipes:
            self._forgotten[id(dp)] = (dp, iterator_id(dp))
            if isinstance(dp, Resumable):
                dp.discard_loaded_state()
            if type(dp) is ShardingFilterIterDataPipe:
                self.sharding.reset(dp)

    def reset(self, graph: List[Tuple[str, DataPipe]]) -> None:
        """A new epoch: every DataPipe of the graph starts afresh (see :meth:`forget`)."""
        self._forgotten = {}
        self.forget(dp for _, dp in graph)

    def _started_since_forgotten(self, dp: DataPipe) -> bool:
        forgotten = self._forgotten.get(id(dp))
        return forgotten is None or iterator_id(dp) != forgotten[1]


def unpack_graph_state(blob: bytes) -> Dict[str, Any]:
    """A :meth:`GraphState.capture` blob as ``{key: state}`` (the global RNGs' checked and
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
