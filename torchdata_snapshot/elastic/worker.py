"""Elastic resume in a worker (plugged into the worker loop as its ``ElasticWorker``; see
:mod:`torchdata_snapshot.core.plugins`): the count of how far into its element the graph's
expander is, and the remaining elements of an epoch resumed elastically."""

from __future__ import annotations

from typing import Optional

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, DataPipeGraph

from torchdata_snapshot.core.messages import ElasticEpoch
from torchdata_snapshot.elastic.element_progress import ElementProgress, with_counting_expander
from torchdata_snapshot.elastic.remaining import load_head_start, set_remaining
from torchdata_snapshot.graph_state.graph_state import GraphState

__all__ = ["ShardingProgress"]


class ShardingProgress:
    """One worker's part of elastic resume, for the epoch in progress."""

    def __init__(self) -> None:
        self._progress: Optional[ElementProgress] = None  # the graph's expander's, if it has one

    def prepare(self, datapipe: DataPipe) -> DataPipe:
        return with_counting_expander(datapipe)

    def reset_epoch(
        self,
        datapipe: DataPipe,
        sharding: ShardingFilterIterDataPipe,
        elastic: Optional[ElasticEpoch],
        graph_state: GraphState,
        stateful: bool,
        graph: DataPipeGraph,
    ) -> bool:
        levels = elastic.levels if elastic is not None else ()
        changed = set_remaining(sharding, levels)
        self._progress = ElementProgress.of(datapipe, sharding, graph)  # (above the filter: unchanged)
        if self._progress is not None:
            self._progress.skip(levels, graph_state.sharding)
        if elastic is not None and elastic.head_states and stateful:
            load_head_start(datapipe, sharding, elastic, graph_state)
        return changed

    def partial(self) -> Optional[int]:
        return None if self._progress is None else self._progress.partial()
