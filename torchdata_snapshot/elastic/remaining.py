"""What remains of an epoch resumed elastically: the elements its sharding filter deals.

The elements of an epoch are those entering the graph's sharding point (its one
``sharding_filter``), in their pre-sharding order ``j = 0, 1, ...``; instance ``i`` of ``n``
(``i = rank * num_workers + worker_id`` under ``DistributedReadingService``) takes those with
``j % n == i``. Each worker counts, for every item it yields, how many elements its sharding
filter had taken (``ShardingShifts.taken``); a checkpoint keeps that count at the user's position.

An epoch resumed with another configuration runs again from its seeds with ``Remaining`` right
below the sharding filter: it drops the elements the user had received, and the sharding filter
deals the others round-robin over the new instances. One ``Level`` per elastic resume in the
same epoch describes what was delivered before it, as positions in the sequence that remained
after the levels before it (an ``ElasticEpoch`` carries them to the workers, with head states: a
new worker loads the pre-sharding part of a graph state an old worker captured before the first
remaining element, instead of running the pre-sharding part from the epoch's start). When all
this is exact is the subject of :mod:`torchdata_snapshot.elastic.resume`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, list_dps

from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.core.messages import ElasticEpoch, Level
from torchdata_snapshot.core.traversal import traverse
from torchdata_snapshot.graph_state.graph_state import GraphState, unpack_graph_state
from torchdata_snapshot.graph_state.resumable import Resumable

__all__ = ["Remaining", "load_head_start", "set_remaining", "skips_of_instance"]


class _Sieve:
    """Decides, element by element, whether it remains after one :class:`Level`, and maps the
    elements that do to their position in the remaining sequence. An element partly delivered
    remains (the one-to-many DataPipe after the sharding filter skips what was delivered of it)."""

    def __init__(self, level: Level) -> None:
        self.n = level.instances
        self.whole = level.whole
        self.total = sum(level.whole)
        self.edge = max(level.whole, default=0) * self.n  # every delivered element lies before it

    def position(self, j: int) -> Optional[int]:
        """``None`` if element ``j`` was delivered whole, else its index among the remaining ones."""
        if j >= self.edge:
            return j - self.total
        n = self.n
        if j // n < self.whole[j % n]:
            return None
        # Delivered elements before j: of instance w, those with index < j, at most whole[w].
        return j - sum(min(t, max(0, (j - w + n - 1) // n)) for w, t in enumerate(self.whole))


def _partial_elements(levels: Sequence[Level]) -> Dict[int, int]:
    """The elements partly delivered before the last of ``levels``: their positions in the
    sequence that remains after it, and how many of their items were delivered (counted from
    each element's first item: a later level's count includes an earlier one's)."""
    partial: Dict[int, int] = {}
    for level in levels:
        sieve = _Sieve(level)
        moved = {sieve.position(j): skip for j, skip in partial.items()}
        for w, (whole, items) in enumerate(zip(level.whole, level.partial)):
            if items:
                moved[sieve.position(whole * level.instances + w)] = items
        partial = {j: skip for j, skip in moved.items() if j is not None}
    return partial


def skips_of_instance(levels: Sequence[Level], instances: int, instance: int) -> Dict[int, int]:
    """For sharding instance ``instance`` of ``instances`` in an epoch resumed elastically after
    ``levels``: by the index of an element among those its sharding filter yields, how many of
    the element's items were delivered before (elements not listed: none)."""
    return {
        j // instances: skip for j, skip in _partial_elements(levels).items() if j % instances == instance
    }


class Remaining(Resumable, IterDataPipe):
    """The elements of ``source`` that remain after ``levels``, in order (see the module
    docstring). Its state is how many elements of ``source`` it went through."""

    STATE = {"index": int}

    def __init__(self, source: IterDataPipe, levels: Sequence[Level]) -> None:
        self.source = source
        self.levels = tuple(levels)
        self._index = 0

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._index = state["index"] if state else 0
        sieves = [_Sieve(level) for level in self.levels]
        for item in self.source:
            position: Optional[int] = self._index
            self._index += 1
            for sieve in sieves:
                position = sieve.position(position)  # type: ignore[arg-type]
                if position is None:
                    break
            else:
                yield item

    def state_dict(self) -> Dict[str, Any]:
        return {"index": self._index}


def set_remaining(sf: ShardingFilterIterDataPipe, levels: Sequence[Level]) -> bool:
    """Put a :class:`Remaining` for ``levels`` right below ``sf`` (replacing one put there
    before); without levels, take it away. Returns whether the graph changed."""
    source = sf.source_datapipe
    had = isinstance(source, Remaining)
    if had:
        source = source.source
    sf.source_datapipe = Remaining(source, levels) if levels else source
    return had or bool(levels)


def _first_remaining_bound(level: Level) -> int:
    """A lower bound of the pre-sharding index of the first element remaining after ``level``:
    its first position that was not delivered whole (an index is never below its position in a
    sequence that remains after earlier levels)."""
    return min(t * level.instances + w for w, t in enumerate(level.whole))


def load_head_start(
    datapipe: DataPipe, sf: ShardingFilterIterDataPipe, epoch: ElasticEpoch, graph_state: GraphState
) -> int:
    """Load into the pre-sharding part of ``datapipe`` (whose sharding filter ``sf`` has its
    :class:`Remaining` in place; ``graph_state`` is that of the worker's graph) the latest of
    ``epoch.head_states`` that lies before the first remaining element, and start the
    :class:`Remaining` there: no element before it is dealt again. Returns that pre-sharding
    index (0: none fits)."""
    *old_levels, last = epoch.levels
    bound = _first_remaining_bound(last)
    remaining = sf.source_datapipe
    assert isinstance(remaining, Remaining)
    root = remaining.source
    pre_sharding = list_dps(traverse(root))
    # The keys the states were captured under: the graph as it was before the resume.
    set_remaining(sf, old_levels)
    try:
        old_keys = {id(dp): key for key, dp in graph_datapipes(datapipe)}
        old_remaining = sf.source_datapipe if old_levels else None
    finally:
        sf.source_datapipe = remaining
    best: Optional[Tuple[int, Dict[str, Any]]] = None
    for instance, blob in epoch.head_states:
        states = unpack_graph_state(blob)
        if old_remaining is not None:
            index = states.get(old_keys[id(old_remaining)], {}).get("index", 0)
        else:  # the filter yielded its y-th element: it had taken instance + (y - 1) * n + 1
            yielded = states.get(old_keys[id(sf)], {}).get("yielded", 0)
            index = instance + (yielded - 1) * last.instances + 1 if yielded else 0
        if index <= bound and (best is None or index > best[0]):
            best = (index, states)
    if best is None or best[0] == 0:
        return 0
    index, states = best
    graph_state.load_datapipe_states([(old_keys[id(dp)], dp) for dp in pre_sharding], states)
    remaining.load_state_dict({"index": index})
    return index
