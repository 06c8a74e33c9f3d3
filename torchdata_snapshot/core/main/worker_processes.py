"""``WorkerProcesses``: the replicable part of the graph running in worker processes.

torchdata's split of the graph is kept: the replicable branch runs in every worker (sharded), the
DataPipes after it stay in the main process, and with ``sharding_round_robin_dispatch`` the part
below the dispatching point runs once, in a dispatching process. The pool starts the processes
(:class:`~torchdata_snapshot.core.main.launcher.ProcessLauncher`), puts a
:class:`~torchdata_snapshot.core.main.consumer.WorkerConsumer` where the replicable branch was, and drives
the workers and (through its :class:`DispatcherClient`) the dispatching process through their
epochs, pauses, limits and snapshots.
See NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages`.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable, List, Optional, Type, TypeVar

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.graph.utils import _find_replicable_branches
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils.dispatch import find_lca_round_robin_sharding_dp

from torchdata_snapshot._compat.datapipes import answer_child_checks
from torchdata_snapshot._constants import EXIT_JOIN_TIMEOUT_S, SMALL_ITEMS_PREFETCH_BYTES
from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.core.main.consumer import WorkerConsumer
from torchdata_snapshot.core.main.launcher import ProcessLauncher
from torchdata_snapshot.core.main.links import Replacer, ReplacerFactory
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.positions import UserPositions, not_one_to_one
from torchdata_snapshot.core.messages import (
    ElasticEpoch,
    ErrorResponse,
    GetStateRequest,
    GetStateResponse,
    LimitRequest,
    LimitResponse,
    PauseRequest,
    PauseResponse,
    Request,
    ResetEpochRequest,
    ResetEpochResponse,
    Response,
    ResumeRequest,
    ResumeResponse,
    TerminateRequest,
    TerminateResponse,
)
from torchdata_snapshot.core.options import FaultOptions, TensorPoolOptions, WorkerOptions
from torchdata_snapshot.core.plugins import StreamLog, require
from torchdata_snapshot.core.transport.channel import Channel
from torchdata_snapshot.core.traversal import replace, seed_graph, traverse
from torchdata_snapshot.core.worker.worker_graph import DispatchPlaceholder

__all__ = ["DispatcherClient", "WorkerProcesses"]

R = TypeVar("R", bound=Response)


class DispatcherClient:
    """The main process's control link to the dispatching process, driven as workers are (see
    :mod:`torchdata_snapshot.core.main.links`): one request at a time, answered within the control
    timeout. An exchange that does not complete leaves the client ``broken``."""

    def __init__(self, channel: Channel, control_timeout_s: float) -> None:
        self.channel = channel
        self.control_timeout_s = control_timeout_s
        self.broken: Optional[str] = None  # why its answers can no longer be trusted

    def ask(self, request: Request, expected: Type[R]) -> R:
        """Send ``request`` and return the answer; an ``ErrorResponse`` is raised as its error."""
        try:
            self.channel.send(request)
            response = self.channel.recv(
                self.control_timeout_s, expected.__name__, option="control_timeout_s", while_busy=True
            )
        except BaseException as e:
            self.broken = f"{type(e).__name__} during {expected.__name__}"
            raise
        if isinstance(response, ErrorResponse):
            response.exc.reraise()
        if not isinstance(response, expected):
            raise ProtocolError(
                f"the dispatching process answered {type(response).__name__}, not {expected.__name__}"
            )
        return response

    def say_goodbye(self) -> bool:
        """Ask the dispatching process to stop; whether it said goodbye (if not, the caller kills it)."""
        if self.broken is not None:
            return False
        try:
            self.ask(TerminateRequest(), TerminateResponse)
        except Exception:
            return False
        return True

    def close(self) -> None:
        self.channel.close()


class WorkerProcesses:
    """Worker processes (and the dispatching process) running one graph; see the module docstring."""

    rng = None  # the workers' global RNGs are their own

    def __init__(
        self,
        launcher: ProcessLauncher,
        consumer: WorkerConsumer,
        dispatcher: Optional[DispatcherClient],
        end: DataPipe,
    ) -> None:
        self.launcher = launcher
        self.consumer = consumer
        self.dispatcher = dispatcher
        self.end = end  # the main process's graph, the consumer where the replicable branch was
        self.num_workers = consumer.num_workers
        self._stopped = False
        self._owner_pid = os.getpid()  # a forked child inherits the exit hook, not the pool
        # A script may end, raise or exit without DataLoader2.shutdown(). Then multiprocessing's
        # own exit handler would join the workers, which ignore SIGTERM (see
        # ignore_job_signals) and wait for this process to end: neither would ever exit. atexit
        # runs handlers last-registered-first, so this one runs before multiprocessing's.
        atexit.register(self._stop_at_exit)

    @classmethod
    def start(
        cls,
        datapipe: DataPipe,
        ctx: Any,
        num_workers: int,
        options: WorkerOptions,
        window: int,
        faults: FaultOptions,
        tensor_pool: Optional[TensorPoolOptions] = None,
        stream_log: Optional[Callable[[], StreamLog]] = None,
    ) -> WorkerProcesses:
        """Split ``datapipe`` and start its processes; the graph is checked before any starts.
        ``tensor_pool``: each worker gets a pool of that size (see
        :class:`~torchdata_snapshot.core.plugins.TensorPoolFeature`); ``stream_log``: makes the
        log each worker stream keeps (a checkpoint's)."""
        graph = traverse(datapipe)
        dispatching_dp = find_lca_round_robin_sharding_dp(graph)
        if dispatching_dp is not None:
            # The non-replicable part runs once, in the dispatching process; a placeholder
            # stands in the workers' graph where it was (replaced by DispatchedSource there).
            graph = replace(graph, dispatching_dp, DispatchPlaceholder())  # type: ignore[abstract, unused-ignore]
            datapipe = list(graph.values())[0][0]
        replicable_dps = _find_replicable_branches(graph)
        if len(replicable_dps) != 1:
            raise ValueError(
                "MultiProcessingReadingService needs exactly one replicable branch in the graph, "
                f"found {len(replicable_dps)}: {[type(dp).__name__ for dp in replicable_dps]}"
            )
        replicable_dp = replicable_dps[0]
        if faults.restart_dead_workers and dispatching_dp is not None:
            raise ValueError(
                "restart_dead_workers is not supported with sharding_round_robin_dispatch: a restarted "
                "worker would need the dispatched items of its stream again"
            )
        launcher = ProcessLauncher(ctx, num_workers, options, tensor_pool)
        dispatcher = None
        links: List[Optional[Channel]] = [None] * num_workers
        try:
            if dispatching_dp is not None:
                control, dispatcher_links = launcher.start_dispatcher(dispatching_dp)
                dispatcher = DispatcherClient(control, faults.control_timeout_s)
                links = list(dispatcher_links)
            channels = launcher.start_workers(replicable_dp, links)
        except BaseException:
            if dispatcher is not None:
                dispatcher.close()
            launcher.stop(0.0)
            raise
        consumer = WorkerConsumer(
            channels,
            window,
            faults.control_timeout_s,
            faults.timeout_s,
            positions=None if not_one_to_one(datapipe, replicable_dp) else UserPositions(num_workers),
            replacer=_replacer(launcher, faults),
            small_items_bytes=SMALL_ITEMS_PREFETCH_BYTES,
            stream_log=stream_log,
        )
        if replicable_dp is datapipe:
            return cls(launcher, consumer, dispatcher, consumer)
        replace(graph, replicable_dp, consumer)
        return cls(launcher, consumer, dispatcher, datapipe)

    @property
    def positions(self) -> Optional[UserPositions]:
        return self.consumer.positions

    @property
    def broken(self) -> Optional[str]:
        """Why the processes can no longer be trusted (an exchange was interrupted), or ``None``."""
        if self.dispatcher is not None and self.dispatcher.broken is not None:
            return self.dispatcher.broken
        return self.consumer.broken

    def start_epoch(
        self,
        outlet: Outlet,
        epoch: int,
        seed_generator: SeedGenerator,
        iter_reset_fn: Optional[Callable],
        elastic: Optional[ElasticEpoch] = None,
        replay: Optional[Callable[[WorkerConsumer], None]] = None,
    ) -> None:
        """Reset every process to ``epoch`` (workers first: one of them may be waiting for a
        dispatched item of the old epoch), ``replay`` a restore (it brings the consumer's streams
        to their restored positions), then let the workers produce. ``elastic``: the epoch
        resumes elastically (see :class:`~torchdata_snapshot.core.messages.ElasticEpoch`)."""
        # The main process's DataPipes (the non-replicable tail) are seeded from the generator
        # itself, each worker from its spawn, as torchdata does.
        graph = traverse(outlet)
        seed_graph(graph, seed_generator)
        answer_child_checks(dp for _, dp in graph_datapipes(outlet, graph))
        seeds = [seed_generator.spawn(worker_id) for worker_id in range(self.num_workers)]
        self.consumer.reset_epoch(epoch, seeds, iter_reset_fn, elastic)
        if self.dispatcher is not None:
            self.dispatcher.ask(
                ResetEpochRequest(seed_generator, iter_reset_fn, epoch=epoch), ResetEpochResponse
            )
        if replay is not None:  # (after the dispatcher's reset: the replay may need its new epoch)
            replay(self.consumer)
        self.consumer.start_epoch()

    def pause(self, pause_fn: Optional[Callable]) -> None:
        # Workers first: they finish their current item, which may need the dispatcher.
        self.consumer.request_pause(pause_fn)
        if self.dispatcher is not None:
            self.dispatcher.ask(PauseRequest(pause_fn), PauseResponse)

    def resume(self, resume_fn: Optional[Callable]) -> None:
        if self.dispatcher is not None:
            self.dispatcher.ask(ResumeRequest(resume_fn), ResumeResponse)
        self.consumer.request_resume(resume_fn)

    def limit(self, num_batches: Optional[int], limit_fn: Callable) -> None:
        """Apply ``limit_fn`` in every process. As in torchdata's loop, the limit only travels when a
        dispatching process exists, and is then split between the workers."""
        if self.dispatcher is None:
            self.consumer.request_limit(None, limit_fn)
            return
        per_worker = None
        if num_batches is not None:
            share, rest = divmod(num_batches, self.num_workers)
            per_worker = [share + (1 if i < rest else 0) for i in range(self.num_workers)]
        self.consumer.request_limit(num_batches, limit_fn, per_worker)
        self.dispatcher.ask(LimitRequest(num_batches, limit_fn), LimitResponse)

    def snapshot(self, outlet: Outlet, epoch: int, paused: bool) -> List[WorkerSnapshot]:
        """One snapshot per worker (and the dispatching process's, last), at one consistent point.

        With a dispatching process: pause the workers, then the dispatcher; take the
        dispatcher's state, then the workers' after they read what it had already sent; resume
        in reverse order.
        """
        if self.dispatcher is None:
            return self.consumer.request_snapshot()
        if not paused:
            self.pause(None)
        try:
            dispatcher = self.dispatcher.ask(GetStateRequest(), GetStateResponse).snapshot
            workers = self.consumer.request_snapshot(dispatcher_sent=dispatcher.sent_per_worker)
        finally:
            if not paused:
                self.resume(None)
        return [*workers, dispatcher]

    def shutdown(self, join_timeout_s: float) -> None:
        """Stop every process (bounded): healthy ones are asked to terminate and get
        ``join_timeout_s`` to exit; after a failure the survivors are killed at once. Idempotent."""
        atexit.unregister(self._stop_at_exit)
        self._stop(join_timeout_s)

    def _stop_at_exit(self) -> None:
        """The interpreter is exiting and nobody shut the pool down: stop it, briefly. In a
        process forked from the owner (``os.fork``), which inherited this hook, do nothing: the
        workers are the owner's."""
        if os.getpid() == self._owner_pid:
            self._stop(EXIT_JOIN_TIMEOUT_S)

    def _stop(self, join_timeout_s: float) -> None:
        if self._stopped:
            return
        self._stopped = True
        graceful = self.consumer.request_terminate(timeout_s=join_timeout_s)
        if self.dispatcher is not None:
            graceful = graceful and self.dispatcher.say_goodbye()
        self.launcher.stop(join_timeout_s if graceful else 0.0)
        self.consumer.close()
        if self.dispatcher is not None:
            self.dispatcher.close()


def _replacer(launcher: ProcessLauncher, faults: FaultOptions) -> Optional[Replacer]:
    """Self-healing when ``restart_dead_workers`` asks for it (an optional feature: see
    :class:`~torchdata_snapshot.core.main.links.Replacer`)."""
    if not faults.restart_dead_workers:
        return None
    make: ReplacerFactory = require("replacer", "restart_dead_workers")
    return make(launcher.restart_worker, faults.restart_dead_workers, faults.control_timeout_s)
