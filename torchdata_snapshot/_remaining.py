"""The sharding point of a worker's graph, whose position every item a worker sends carries.

The elements of an epoch are those entering the graph's sharding point (its one
``sharding_filter``), in their pre-sharding order ``j = 0, 1, ...``; instance ``i`` of ``n``
(``i = rank * num_workers + worker_id`` under ``DistributedReadingService``) takes those with
``j % n == i``. Each worker counts, for every item it yields, how many elements its sharding
filter had taken (:func:`~torchdata_snapshot._stateful.sharding_taken`); a checkpoint keeps that
count at the user's position.
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, find_dps, traverse_dps

__all__ = ["sharding_layout", "sharding_point"]


def sharding_point(datapipe: DataPipe) -> Optional[ShardingFilterIterDataPipe]:
    """The graph's one sharding filter, or ``None`` if it has none or several."""
    found = find_dps(traverse_dps(datapipe), ShardingFilterIterDataPipe)
    return found[0] if len(found) == 1 else None


def sharding_layout(sf: ShardingFilterIterDataPipe) -> Tuple[int, int]:
    """``(world_size, rank)`` that ``DistributedReadingService`` gave the filter (``(1, 0)``
    without one)."""
    return tuple(sf.groups.get(SHARDING_PRIORITIES.DISTRIBUTED, (1, 0)))  # type: ignore[return-value]
