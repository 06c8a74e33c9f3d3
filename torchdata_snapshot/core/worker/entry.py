"""A worker process's entry point: it prepares the worker's graph and runs the most capable worker
loop installed on it until the main process terminates it or is gone.

The core's :class:`~torchdata_snapshot.core.worker.loop.WorkerLoop` only streams; the loop that
restores too is found by its module's name (``worker_loop`` in
:mod:`torchdata_snapshot.core.plugins`), so that the core imports no checkpoint module.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Type

import torch
from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.graph._serialization import extract_wrapper
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._errors import ExceptionWrapper
from torchdata_snapshot.core.options import WorkerOptions
from torchdata_snapshot.core.plugins import installed
from torchdata_snapshot.core.transport.channel import Channel, Endpoint, ParentWatch
from torchdata_snapshot.core.transport.item_codec import ItemPool
from torchdata_snapshot.core.worker.dispatcher import DispatchedSource
from torchdata_snapshot.core.worker.heap import keep_heap
from torchdata_snapshot.core.worker.loop import WorkerLoop
from torchdata_snapshot.core.worker.signals import ignore_job_signals
from torchdata_snapshot.core.worker.worker_graph import prepare_worker_graph

__all__ = ["installed_loop", "run_worker"]


def installed_loop() -> Type[WorkerLoop]:
    """The most capable worker loop installed: the one that restores (``worker_loop`` in
    :mod:`torchdata_snapshot.core.plugins`), else the core's, which only streams."""
    return installed().worker_loop or WorkerLoop


def run_worker(
    datapipe: DataPipe,
    endpoint: Endpoint,
    worker_info: WorkerInfo,
    parent_pid: int,
    options: WorkerOptions,
    dispatcher_link: Optional[Channel] = None,
    dispatcher_pid: Optional[int] = None,
    pool: Optional[ItemPool] = None,
    loop_args: Optional[Mapping[str, Any]] = None,
) -> None:
    """Entry point of a worker process: runs the most capable worker loop installed, ``loop_args``
    being the keyword arguments of its own (the state functions of stateful restore)."""
    if pool is not None:
        pool.close_fd()  # (inherited under fork) the mapping keeps the memory
    torch.set_num_threads(1)
    keep_heap()  # before the graph allocates: see heap.py
    ignore_job_signals()
    endpoint.parent = ParentWatch(parent_pid)
    if dispatcher_link is not None:
        dispatcher_link.bind("dispatching process", watch=endpoint.check_parent, pid=dispatcher_pid)
    init_error = None
    try:
        dispatched = None if dispatcher_link is None else DispatchedSource(dispatcher_link)
        datapipe = prepare_worker_graph(
            extract_wrapper(datapipe), worker_info, options.custom_init_fn, dispatched
        )
    except Exception:
        init_error = ExceptionWrapper(
            where=f"in worker process {worker_info.worker_id} while initializing it"
        )
    loop = installed_loop()(
        datapipe, endpoint, worker_info, options=options, init_error=init_error, pool=pool,
        **(loop_args or {}),
    )  # fmt: skip
    try:
        loop.run()
    finally:
        endpoint.close()
