"""Stateful restore: resume a worker's graph from captured DataPipe states instead of replaying it.

Replay costs as much as re-reading the items the user already received this epoch. When every
DataPipe of a worker's graph can report its state and resume from it, the worker instead
captures its graph's state as often as 1% of its production time allows, at most every
``max_items_between_captures`` items (the states travel to the main process with the data), and a restore
loads the latest one at or before the user's position, then replays only the few items after
it: restore time does not depend on the position.

A DataPipe is resumable when, at a moment the graph's output has just yielded (every generator
of a pull-based graph is then suspended at its own ``yield``), its future output is determined
by its sources' future output plus a small state:

* stateless at yield points (resume by iterating afresh over resumed sources): ``Mapper``,
  ``Collator``, ``Filter``, ``Batcher``, ``Zipper`` (functions are assumed to be pure);
* ``ShardingFilter``: stays in place (``DataLoader2`` finds it by its exact type when seeding);
  its state is how many items it yielded, from which follows how many it took from its source;
  a resumed epoch shifts its ``instance_id`` accordingly (``graph_state.sharding_shift``);
* torch's and torchdata's DataPipes whose state lives in generator frames become, in the
  worker, instances of subclasses that keep it in attributes (``graph_state.equivalents``):
  ``IterableWrapper`` (over a sequence or range), ``Shuffler`` (only its reset changes),
  ``UnBatcher``, ``FlatMapper``, ``Header``, ``Cycler``, ``Concater``, ``Multiplexer``,
  ``FileLister``; the readers, which open, decompress, unpack and parse files, run their own
  code one element at a time (``graph_state.readers``); they yield exactly what the originals
  yield, epoch after epoch;
* any DataPipe with ``state_dict()`` and ``load_state_dict(state)`` methods, or whose type was
  registered with :func:`~torchdata_snapshot.register_state_functions` (``graph_state.state_functions``).
  ``load_state_dict`` is
  called before the resumed epoch's iterator starts; the next iteration must continue from that
  state.

The worker's global ``random``/``torch``/``numpy`` states are part of the captured state, so
map functions drawing from them resume exactly too.

A captured state describes the iterations in progress at that moment, and only DataPipes that
started an iteration in the current epoch (or in the current pass of an enclosing ``cycle()``)
are captured, or were given a state since and have not started yet: after a restore, a reader
finishes the file it was restored in before it pulls from its source, and a capture meanwhile
records the state loaded into the source, which is where it still stands. Once the run moves
past those iterations (a new epoch, a new pass of ``cycle()``) whatever was loaded into the
DataPipes below is forgotten, so that they start afresh (``GraphState.forget``).

This module holds the ``GraphState`` each worker keeps for its graph: which DataPipes can
resume, the rewrite into resumable DataPipes, capturing and loading the graph's state, and forgetting.
It is created with the registered state functions the main process sent the worker: a worker
started by ``spawn`` or ``forkserver`` does not run the code that registered them.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe
from torchdata.datapipes.iter import Cycler as CyclerIterDataPipe

from torchdata_snapshot._compat.datapipes import iterator_id
from torchdata_snapshot._errors import StateCaptureError, StateRestoreError
from torchdata_snapshot.checkpoint.rng_states import (
    check_global_rng_state,
    packed_global_rng_state,
    set_global_rng_state,
    unpack_global_rng_state,
)
from torchdata_snapshot.core.catalogue import types_where
from torchdata_snapshot.core.graph import datapipe_state_dicts, describe_datapipe, graph_datapipes
from torchdata_snapshot.core.traversal import replace, traverse
from torchdata_snapshot.graph_state.accumulators import ACCUMULATOR_ADAPTERS
from torchdata_snapshot.graph_state.equivalents import ADAPTERS
from torchdata_snapshot.graph_state.readers import READER_ADAPTERS
from torchdata_snapshot.graph_state.resumable import Adapter, Resumable
from torchdata_snapshot.graph_state.sharding_shift import ShardingShifts
from torchdata_snapshot.graph_state.state_functions import StateFunctions, registered_state_functions

__all__ = [
    "RESUMABLE_ADAPTERS",
    "RESUMABLE_STATELESS",
    "GraphState",
    "rewrite_graph_state",
    "unpack_graph_state",
]

_RNG_KEY = "__global_rng__"

#: How each DataPipe type of torch and torchdata that keeps state in a generator frame is made
#: resumable (``adapted`` in :mod:`torchdata_snapshot.core.catalogue`), and the types that hold
#: no state at a yield point (``stateless`` there).
RESUMABLE_ADAPTERS: Dict[type, Adapter] = {**ADAPTERS, **READER_ADAPTERS, **ACCUMULATOR_ADAPTERS}
RESUMABLE_STATELESS = types_where(stateless=True)


def _has_methods(dp: DataPipe) -> bool:
    return callable(getattr(dp, "state_dict", None)) and callable(getattr(dp, "load_state_dict", None))


#: How a DataPipe's state is taken and loaded: ``(state_dict(dp), load_state_dict(dp, state))``.
_Functions = Tuple[Callable[[Any], Any], Callable[[Any, Any], None]]


class GraphState:
    """The states of one worker's graph: how each DataPipe's state is taken and loaded, and which
    states were forgotten (see :meth:`forget`).

    The worker creates it with the registered state functions it was sent (``carried``, see
    :func:`graph_state_functions`); a type it was not sent uses what was registered in the
    worker's own process. torchdata's ``ShardingFilter`` has built-in ones (:class:`ShardingShifts`).
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
        #: ``id(dp)`` -> ``(dp, the state loaded into it)`` since it was last forgotten: while
        #: ``dp`` has not started, that state is still its state.
        self._loaded: Dict[int, Tuple[DataPipe, Any]] = {}

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
            if type(dp) in RESUMABLE_STATELESS or self._functions(dp) is not None or _has_methods(dp):
                continue
            adapter = RESUMABLE_ADAPTERS.get(type(dp))
            if adapter is None or not adapter.adapts(dp):
                return describe_datapipe(dp)
        return None

    def make_resumable(self, datapipe: DataPipe) -> DataPipe:
        """Rewrite a resumable graph (see :meth:`unresumable`): each DataPipe whose state lives in
        its generator becomes resumable (an instance of its resumable subclass, in place, or
        wrapped). ``ShardingFilter`` stays: ``DataLoader2`` finds it by its exact type."""
        graph = traverse(datapipe)
        for _, dp in graph_datapipes(datapipe, graph):
            adapter = RESUMABLE_ADAPTERS.get(type(dp))
            if adapter is not None and not _has_methods(dp) and adapter.adapts(dp):
                replacement = adapter.adapt(dp)
                if replacement is not dp:
                    graph = replace(graph, dp, replacement)
        made = next(iter(graph.values()))[0]
        for _, dp in graph_datapipes(made, graph):
            if isinstance(dp, CyclerIterDataPipe) and isinstance(dp, Resumable):
                cycler: Any = dp  # (on_new_pass is its resumable class's)
                cycler.on_new_pass = self._forgetting(cycler.source_datapipe)
        return made

    def _forgetting(self, source: DataPipe) -> Callable[[], None]:
        """What a ``Cycler`` of ``source`` does before each pass after the first: forget the
        states of its source's subgraph (looked up at the first such pass)."""
        subgraph: List[DataPipe] = []

        def forget_source() -> None:
            if not subgraph:
                subgraph.extend(dp for _, dp in graph_datapipes(source))
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
                if id(dp) in self._loaded:  # given a state and not started since: it stands there
                    states[key] = self._loaded[id(dp)][1]
                continue  # else not started in this epoch (or pass): it starts afresh after a restore too
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
            except StateRestoreError:
                raise  # it says what is wrong (a file that changed)
            except Exception as e:
                what = f"load_state_dict() of DataPipe {key} ({describe_datapipe(dp)})"
                raise StateRestoreError(f"{what} raised {type(e).__name__}: {e}") from e
            self._loaded[id(dp)] = (dp, states[key])

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
            self._loaded.pop(id(dp), None)
            if isinstance(dp, Resumable):
                dp.discard_loaded_state()
            if type(dp) is ShardingFilterIterDataPipe:
                self.sharding.reset(dp)

    def reset(self, graph: List[Tuple[str, DataPipe]]) -> None:
        """A new epoch: every DataPipe of the graph starts afresh (see :meth:`forget`)."""
        self._forgotten, self._loaded = {}, {}
        self.forget(dp for _, dp in graph)

    def _started_since_forgotten(self, dp: DataPipe) -> bool:
        forgotten = self._forgotten.get(id(dp))
        return forgotten is None or iterator_id(dp) != forgotten[1]


def _unpickled(blob: bytes, unpack_rng: bool) -> Dict[str, Any]:
    try:
        states = pickle.loads(blob)
        if not isinstance(states, dict) or _RNG_KEY not in states:
            raise ValueError(f"it unpickles to {type(states).__name__}, not the state of a graph")
        if unpack_rng:
            states[_RNG_KEY] = unpack_global_rng_state(states[_RNG_KEY])
            check_global_rng_state(states[_RNG_KEY])
    except Exception as e:
        raise StateRestoreError(f"the worker's graph state cannot be loaded: {type(e).__name__}: {e}") from e
    return states


def unpack_graph_state(blob: bytes) -> Dict[str, Any]:
    """A :meth:`GraphState.capture` blob as ``{key: state}`` (the global RNGs' checked and
    unpacked), or :class:`StateRestoreError` saying that it is not such a state."""
    return _unpickled(blob, unpack_rng=True)


def rewrite_graph_state(blob: bytes, rewrite: Callable[[Any], Any]) -> bytes:
    """A :meth:`GraphState.capture` blob with the state of each of its DataPipes put through
    ``rewrite`` (the global RNGs' left as they are), or :class:`StateRestoreError` saying that
    it is not such a state. The main process reads a worker's state this way only to rewrite it
    (the paths of a data directory that moved)."""
    states = _unpickled(blob, unpack_rng=False)
    rewritten = {key: state if key == _RNG_KEY else rewrite(state) for key, state in states.items()}
    return pickle.dumps(rewritten, protocol=pickle.HIGHEST_PROTOCOL)
