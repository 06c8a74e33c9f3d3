"""How far into its current element a worker's expander is, for elastic resume.

In a graph that resumes elastically, at most one DataPipe after the sharding filter yields
several items per element (an *expander*: a reader, ``flatmap``, ``unbatch``; see
:mod:`torchdata_snapshot.elastic.resume`). With each item, a worker records its sharding filter's
count (``taken``) and ``ElementProgress.partial()``: the items of the expander's current
element that were handed on, less the one a DataPipe after it may hold (``webdataset``'s next
sample, ``lines_to_paragraphs``'s next paragraph). An elastic resume deals that element again,
and the expander skips that many of its items (``ElementProgress.skip()``).

The expander and the DataPipes that hold an item are made resumable
(:class:`~torchdata_snapshot.graph_state.resumable.Expander`), which count; a graph that is not made
resumable as a whole gets just them made so (``with_counting_expander()``). They yield what the
originals yield.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, DataPipeGraph

from torchdata_snapshot.core.catalogue import types_where
from torchdata_snapshot.core.graph import sharding_point
from torchdata_snapshot.core.messages import Level
from torchdata_snapshot.core.traversal import replace, subgraph, traverse
from torchdata_snapshot.elastic.remaining import skips_of_instance
from torchdata_snapshot.graph_state.graph_state import RESUMABLE_ADAPTERS
from torchdata_snapshot.graph_state.resumable import Expander, as_resumable
from torchdata_snapshot.graph_state.sharding_shift import ShardingShifts

__all__ = [
    "EXPANDING",
    "HOLDING_ONE",
    "ONE_TO_ONE",
    "ElementProgress",
    "chain_after",
    "with_counting_expander",
]

#: DataPipes that yield one item per element, holding nothing at a yield point, by exact type:
#: they may also stand between the sharding point and the graph's expander.
ONE_TO_ONE: Tuple[type, ...] = types_where(per_element="one")

#: Expanders: DataPipes that yield several items per element, the same ones each time for the
#: same element (files unchanged, functions deterministic). One may run after the sharding
#: point of an elastic graph; a new worker skips the items of its element the user had.
EXPANDING: Tuple[type, ...] = types_where(per_element="several")

#: DataPipes that, after an expander, hold at most the item they took last when they yield (the
#: first of the next sample or paragraph, an item of the expander's current element).
HOLDING_ONE: Tuple[type, ...] = types_where(per_element="holds_one")


def chain_after(
    sf: DataPipe, end: DataPipe, graph: Optional[DataPipeGraph] = None
) -> Union[List[DataPipe], DataPipe]:
    """The DataPipes from ``sf`` (excluded) to ``end``, nearest to ``sf`` first; or, if they are
    not a chain, the first one from ``end`` that has several sources (``graph``: one that holds
    ``end``'s, if the caller traversed it already)."""
    chain: List[DataPipe] = []
    node = traverse(end) if graph is None else subgraph(graph, end)
    while True:
        ((dp, parents),) = node.values()
        if dp is sf:
            return chain[::-1]
        if len(parents) != 1:
            return dp
        chain.append(dp)
        node = parents


def _expander_at(chain: Sequence[DataPipe]) -> int:
    """The index of the chain's one expander (the original or made resumable), or -1 if not one."""
    found = [i for i, dp in enumerate(chain) if type(dp) in EXPANDING or isinstance(dp, Expander)]
    return found[0] if len(found) == 1 else -1


class ElementProgress:
    """The expander after a worker graph's sharding filter ``sf`` and the DataPipes after it
    that may hold one of its items."""

    def __init__(self, expander: Expander, holders: List[DataPipe], sf: ShardingFilterIterDataPipe) -> None:
        self.expander = expander
        self.holders = holders
        self.sf = sf

    @classmethod
    def of(
        cls, datapipe: DataPipe, sf: ShardingFilterIterDataPipe, graph: Optional[DataPipeGraph] = None
    ) -> Optional[ElementProgress]:
        """The progress of ``datapipe``'s expander after ``sf``, if it has one (in a chain;
        ``graph``: as in :func:`chain_after`)."""
        chain = chain_after(sf, datapipe, graph)
        at = _expander_at(chain) if isinstance(chain, list) else -1
        expander = chain[at] if at >= 0 else None
        if not isinstance(expander, Expander):
            return None
        return cls(expander, [dp for dp in chain[at + 1 :] if hasattr(dp, "held_items")], sf)

    def partial(self) -> int:
        """At a yield point of the graph: the items of the expander's current element handed on
        and not held after it (those a resume skips)."""
        return self.expander.element_items() - sum(dp.held_items() for dp in self.holders)

    def skip(self, levels: Sequence[Level], shifts: ShardingShifts) -> None:
        """Make the expander skip, in this epoch, the items delivered before ``levels`` of each
        element its sharding filter yields (none without ``levels``: not elastic)."""
        if not levels:
            self.expander.skip_per_element(None)
            return
        sf = self.sf
        skips: Dict[int, int] = skips_of_instance(levels, sf.num_of_instances, sf.instance_id)
        # The element being expanded is the one the filter yielded last (only DataPipes that take
        # one element at a time stand between them; see elastic.resume.elastic_refusal).
        self.expander.skip_per_element(lambda: skips.get(shifts.taken(sf) - 1, 0))


def with_counting_expander(datapipe: DataPipe) -> DataPipe:
    """``datapipe`` (a worker's graph, not made resumable as a whole) with its original expander
    after its sharding filter, and the DataPipes after it that may hold an item, made resumable:
    they count, and yield what the originals yield."""
    sf = sharding_point(datapipe)
    chain = [] if sf is None else chain_after(sf, datapipe)
    at = _expander_at(chain) if isinstance(chain, list) else -1
    if at < 0:
        return datapipe
    graph = traverse(datapipe)
    for dp in chain[at:]:
        if isinstance(dp, IterDataPipe) and (type(dp) in EXPANDING or type(dp) in HOLDING_ONE):
            # Its adapter's (in place, or a wrapper); itself where its class counts already, or
            # where it cannot resume (nothing counts then: an elastic restore refuses the state).
            counting = as_resumable(dp, RESUMABLE_ADAPTERS)
            if counting is not dp:
                graph = replace(graph, dp, counting)
    return next(iter(graph.values()))[0]
