"""``ProcessLauncher``: starts, restarts and stops the processes of one reading service.

The workers run the replicable branch of the graph; with ``sharding_round_robin_dispatch`` a
dispatching process runs the part below it once. Every child gets its ends of its pipes; this
process closes its copies of them right after the start, so that a child's death reads as
end-of-file here (see NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages`).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from multiprocessing.process import BaseProcess
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.graph._serialization import attach_wrapper
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._constants import JOIN_TIMEOUT_S
from torchdata_snapshot._errors import WorkerDiedError
from torchdata_snapshot.core.options import TensorPoolOptions, WorkerOptions
from torchdata_snapshot.core.plugins import own_process_start, require
from torchdata_snapshot.core.transport.channel import Channel, describe_exit, make_pipe_pair, process_exit
from torchdata_snapshot.core.transport.item_codec import ItemPool
from torchdata_snapshot.core.worker.dispatcher import run_dispatcher
from torchdata_snapshot.core.worker.entry import installed_loop, run_worker

__all__ = ["ProcessLauncher", "import_what_workers_seed"]

logger = logging.getLogger(__name__)


def import_what_workers_seed(ctx: Any) -> None:
    """Import ``numpy.random`` here once before forking workers, if numpy is imported.

    Each worker's first epoch reset seeds numpy's global RNG (``process_reset_fn``),
    which imports ``numpy.random`` if nobody did: 10 of that reset's 13 ms, in every worker, at
    every start and restore. Forked workers inherit the import; under spawn and forkserver a
    worker imports what it needs in its own process, and this one is left alone.
    """
    if ctx.get_start_method() == "fork" and "numpy" in sys.modules:
        importlib.import_module("numpy.random")


def _exited(process: BaseProcess) -> bool:
    try:
        return process.exitcode is not None
    except ValueError:  # closed (a replaced worker): it had exited
        return True


class ProcessLauncher:
    """The processes of one reading service, started with the multiprocessing context ``ctx``."""

    def __init__(
        self, ctx: Any, num_workers: int, options: WorkerOptions, pool: Optional[TensorPoolOptions] = None
    ) -> None:
        self.ctx = ctx
        self.num_workers = num_workers
        self.options = options
        self.pool = pool  # each worker started gets a tensor pool of its own, when set
        self.workers: List[Optional[BaseProcess]] = [None] * num_workers
        self.dispatcher: Optional[BaseProcess] = None
        self._dispatcher_pid: Optional[int] = None
        self._worker_graph: Any = None  # the replicable branch, wrapped for pickling
        self._loop_args: Dict[str, Any] = {}  # what the worker loop needs of this process
        self._pools: List[Tuple[BaseProcess, ItemPool]] = []  # every worker's, replaced ones too

    @property
    def processes(self) -> List[BaseProcess]:
        started = [process for process in self.workers if process is not None]
        return started if self.dispatcher is None else [*started, self.dispatcher]

    def start_dispatcher(self, dispatching_dp: DataPipe) -> Tuple[Channel, List[Channel]]:
        """Start the dispatching process; return its control channel and, per worker, the
        worker's end of its link to it."""
        control, control_endpoint, control_child_ends = make_pipe_pair(self.ctx)
        links = [make_pipe_pair(self.ctx) for _ in range(self.num_workers)]
        process = self.ctx.Process(
            target=run_dispatcher,
            args=(
                attach_wrapper(dispatching_dp),
                control_endpoint,
                [endpoint for _, endpoint, _ in links],
                os.getpid(),
                self.options.batching,
                self.options.custom_reset_fn,
            ),
            name="DataLoader2 dispatcher",
            daemon=True,
        )
        with own_process_start():
            process.start()
        self.dispatcher, self._dispatcher_pid = process, process.pid
        for end in control_child_ends:
            end.close()
        for _, _, child_ends in links:
            for end in child_ends:
                end.close()
        return control.bind("dispatching process", process), [channel for channel, _, _ in links]

    def start_workers(
        self, replicable_dp: DataPipe, dispatcher_links: Sequence[Optional[Channel]]
    ) -> List[Channel]:
        """Start every worker on ``replicable_dp``; return their channels, in worker order."""
        start_method = self.ctx.get_start_method()
        self._loop_args = installed_loop().carried_arguments(replicable_dp, self.options, start_method)
        self._worker_graph = attach_wrapper(replicable_dp)
        import_what_workers_seed(self.ctx)
        channels: List[Channel] = []
        try:
            for worker_id in range(self.num_workers):
                channels.append(self.start_worker(worker_id, dispatcher_links[worker_id]))
        except BaseException:
            for channel in channels:
                channel.close()
            raise
        return channels

    def start_worker(self, worker_id: int, dispatcher_link: Optional[Channel] = None) -> Channel:
        """Start worker ``worker_id``; return its channel."""
        dispatcher_pid = None if self.dispatcher is None else self._dispatcher_pid
        channel, endpoint, child_ends = make_pipe_pair(self.ctx)
        info = WorkerInfo(self.num_workers, worker_id)
        pool = None if self.pool is None else require("tensor_pool", "tensor_pool=True")(self.pool)
        args = (
            self._worker_graph,
            endpoint,
            info,
            os.getpid(),
            self.options,
            dispatcher_link,
            dispatcher_pid,
            pool,
            self._loop_args,
        )
        process = self.ctx.Process(
            target=run_worker, args=args, name=f"DataLoader2 worker {worker_id}", daemon=True
        )
        try:
            with own_process_start():  # a worker reads none of the user's pooled tensors
                process.start()
        finally:
            if pool is not None:
                pool.close_fd()  # the worker has its own (or failed to start); the mapping stays
        self.workers[worker_id] = process
        for end in child_ends:
            end.close()  # so that the worker's death reads as end-of-file here
        if dispatcher_link is not None:
            dispatcher_link.close()  # the worker's end of its link to the dispatcher
        channel.pool = pool
        if pool is not None:
            self._pools.append((process, pool))
        return channel.bind(f"worker {worker_id}", process, watch=self.check_dispatcher)

    def restart_worker(self, worker_id: int) -> Channel:
        """Self-healing: reap dead worker ``worker_id`` and start a fresh one in its place."""
        dead = self.workers[worker_id]
        assert dead is not None
        dead.join(JOIN_TIMEOUT_S)
        logger.warning(
            "worker %d (pid %d) died (%s); restarting it and replaying its stream to where it stopped "
            "(restart_dead_workers)",
            worker_id,
            dead.pid,
            describe_exit(dead.exitcode),
        )
        if dead.exitcode is not None:
            dead.close()
        return self.start_worker(worker_id)

    def _trim_pools(self) -> None:
        """The pools of exited workers give back what no tensor of the user's views: a tensor kept
        past ``shutdown()`` then holds its own pages, not its worker's pool. (One whose worker
        is still alive, a kill that did not take, may still be written: left whole.) The
        launcher keeps none of them after this: each is unmapped with the last view of it."""
        pools, self._pools = self._pools, []
        for process, pool in pools:
            if _exited(process):
                pool.trim()

    def check_dispatcher(self) -> None:
        """Liveness check run by every wait on a worker: the worker may be waiting for the dispatcher."""
        if self.dispatcher is None:
            return
        exited, code = process_exit(self.dispatcher)
        if exited:
            how = describe_exit(code)
            raise WorkerDiedError(
                f"dispatching process (pid {self._dispatcher_pid}) exited unexpectedly with {how}"
            )

    def stop(self, wait_s: float) -> None:
        """Join every process within ``wait_s`` (in total), then kill those still alive (bounded),
        and release what each held in this process (its sentinel pipe) at once, not when the
        loader is garbage collected."""
        processes = self.processes
        deadline = time.monotonic() + wait_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.exitcode is None:
                process.kill()
        for process in processes:
            process.join(JOIN_TIMEOUT_S)
        self._trim_pools()
        for process in processes:
            if process.exitcode is not None:
                process.close()
