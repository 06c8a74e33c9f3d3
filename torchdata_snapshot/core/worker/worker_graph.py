"""The graph a process of the reading service runs: sharded for it, ``worker_init_fn`` applied.

A worker fed by a dispatching process gets the source that reads from it in place of the
placeholder ``DataLoader2`` put where the dispatched part was; only the branches that do not
come from it are sharded.
"""

from __future__ import annotations

from typing import Callable, Optional, Type, cast

import torch
from torch.utils.data import IterDataPipe as _TorchIterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2.graph import DataPipe, find_dps
from torchdata.dataloader2.utils.dispatch import _DummyIterDataPipe, find_non_dispatching_branches
from torchdata.dataloader2.utils.worker import WorkerInfo
from torchdata.datapipes.iter import IterDataPipe
from torchdata.datapipes.map import MapDataPipe

from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot.core.traversal import replace, traverse

__all__ = ["DispatchPlaceholder", "prepare_worker_graph"]

#: The placeholder DataLoader2 puts where the dispatched part of a graph was; typed as torch's
#: IterDataPipe, which ``find_dps`` expects (torchdata's generated stubs declare their own).
DispatchPlaceholder = cast(Type[_TorchIterDataPipe], _DummyIterDataPipe)


def prepare_worker_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    custom_init_fn: Optional[Callable[[DataPipe, WorkerInfo], DataPipe]] = None,
    dispatched: Optional[DataPipe] = None,
) -> DataPipe:
    """Shard the replicable graph for this worker, then apply ``custom_init_fn`` (``worker_init_fn``).

    With a dispatching process, ``dispatched`` (the source reading from it) takes the place of
    the placeholder where the dispatched part was, and only the branches that do not come from
    it are sharded. Raises ``ProtocolError`` for a placeholder without ``dispatched``, and
    ``TypeError`` if ``worker_init_fn`` returns no DataPipe.
    """
    graph = traverse(datapipe)
    placeholders = find_dps(graph, DispatchPlaceholder)
    if not placeholders:
        torch.utils.data.graph_settings.apply_sharding(
            datapipe, worker_info.num_workers, worker_info.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
        )
    else:
        if len(placeholders) != 1 or dispatched is None:
            raise ProtocolError(
                "a worker graph with a dispatched part needs exactly one link to the dispatcher"
            )
        for branch in find_non_dispatching_branches(graph):
            torch.utils.data.graph_settings.apply_sharding(
                branch, worker_info.num_workers, worker_info.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
            )
        graph = replace(graph, placeholders[0], dispatched)
        datapipe = list(graph.values())[0][0]
    if custom_init_fn is not None:
        datapipe = custom_init_fn(datapipe, worker_info)
        if not isinstance(datapipe, (IterDataPipe, MapDataPipe)):
            raise TypeError(f"worker_init_fn returned {type(datapipe).__name__}, not a DataPipe")
    return datapipe
