"""``process_init_fn``: the graph a process of a reading service runs, made from the whole graph
(``InProcessReadingService``'s, for one).

A graph with a dispatched part (``sharding_round_robin_dispatch``) is the worker loop's to make:
it gives :func:`~torchdata_snapshot.core.worker.worker_graph.prepare_worker_graph` the source
that reads from the dispatching process. Here a graph has none, and one that has is refused,
where torchdata's own function linked it to the queue-based loop's queues.
"""

from __future__ import annotations

from typing import Callable, Optional

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot.core.worker.worker_graph import prepare_worker_graph

__all__ = ["process_init_fn"]


def process_init_fn(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    custom_init_fn: Optional[Callable[[DataPipe, WorkerInfo], DataPipe]] = None,
    worker_prefetch_cnt: int = 0,
) -> DataPipe:
    """Shard ``datapipe`` for the worker ``worker_info`` names, apply ``custom_init_fn`` (a reading
    service's ``worker_init_fn``) and prefetch ``worker_prefetch_cnt`` items after it.

    Raises ``ProtocolError`` for a graph with a dispatched part (``sharding_round_robin_dispatch``),
    which only the worker loop can link to its dispatching process, and ``TypeError`` when
    ``custom_init_fn`` returns something other than a DataPipe.
    """
    datapipe = prepare_worker_graph(datapipe, worker_info, custom_init_fn)
    if worker_prefetch_cnt > 0:
        datapipe = datapipe.prefetch(worker_prefetch_cnt)
    return datapipe
