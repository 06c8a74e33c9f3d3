"""``MultiProcessingReadingService``: a drop-in, observable replacement for upstream's.

The reading service only orchestrates: it splits the graph (replicable branch to the workers,
non-replicable tail in the main process), starts the processes, and drives them through
:class:`~torchdata_snapshot._consumer.WorkerConsumer`. The protocol is described in
NOTE [ Snapshot protocol ] (:mod:`torchdata_snapshot._messages`).
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, TypeVar

import torch.multiprocessing as mp
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
from torchdata.dataloader2 import reading_service as upstream
from torchdata.dataloader2.graph import DataPipe, list_dps, replace_dp, set_graph_random_seed, traverse_dps
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.reading_service import CheckpointableReadingServiceInterface
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import FullSync as FullSyncIterDataPipe
from torchdata.datapipes.iter import Prefetcher as PrefetcherIterDataPipe

from torchdata_snapshot._channel import Channel, describe_exit, make_pipe_pair
from torchdata_snapshot._checkpoint import Checkpoint, WorkerPosition, graph_fingerprint
from torchdata_snapshot._compat import (
    DispatchPlaceholder,
    attach_wrapper,
    find_lca_round_robin_sharding_dp,
    find_replicable_branches,
    process_init_fn,
    process_reset_fn,
)
from torchdata_snapshot._constants import JOIN_TIMEOUT_S, NO_EPOCH
from torchdata_snapshot._consumer import WorkerConsumer, credit_window
from torchdata_snapshot._dispatch import run_dispatcher
from torchdata_snapshot._errors import (
    ProtocolError,
    ReadingServiceClosedError,
    ReadingServiceError,
    WorkerDiedError,
)
from torchdata_snapshot._graph import datapipe_state_dicts, datapipe_yields, graph_datapipes, pausable, paused
from torchdata_snapshot._messages import (
    ErrorResponse,
    GetStateRequest,
    GetStateResponse,
    LimitRequest,
    LimitResponse,
    PauseRequest,
    PauseResponse,
    ResetEpochRequest,
    ResetEpochResponse,
    ResumeRequest,
    ResumeResponse,
    TerminateRequest,
    TerminateResponse,
)
from torchdata_snapshot._options import (
    BatchingOptions,
    FaultOptions,
    RestoreOptions,
    WorkerOptions,
    _check_count,
)
from torchdata_snapshot._outlet import Outlet
from torchdata_snapshot._positions import UserPositions
from torchdata_snapshot._rng import IsolatedRNG
from torchdata_snapshot._seeds import load_seed_state, seed_state
from torchdata_snapshot._worker import run_worker
from torchdata_snapshot._worker_snapshot import WorkerSnapshot

__all__ = ["MultiProcessingReadingService"]


def _shut_down_when_broken(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a control operation; if it left the processes in an unknown state (a worker died, a
    wait timed out, Ctrl-C between a request and its answer), shut everything down before the
    exception propagates: no process outlives the failure, no later call reads a stale answer."""

    @functools.wraps(method)
    def guarded(self: MultiProcessingReadingService, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            if self._broken() and not self._finalized:
                self.finalize()
            raise

    return guarded


def advance_epoch_seed(seed_generator: SeedGenerator, epoch: int) -> None:
    """Make every epoch's seeds differ, deterministically.

    Upstream's MPRS seeds workers with ``seed_generator.spawn(worker_id)``, which does not
    advance the generator: unless a random DataPipe runs in the main process, every epoch gets
    the same seeds, so a seeded DataLoader2 repeats the same shuffle each epoch. Here the shared
    stream is advanced by one draw and the per-process stream is spawned for the epoch, which
    keeps the rank-specific part that ``DistributedReadingService`` put there.
    """
    seed_generator.generate_shared_seed()
    seed_generator.spawn(epoch, inplace=True)


#: Main-process DataPipes that hand on exactly one item per item they take, in order. Through a
#: tail made only of these, the user's position maps onto the workers' streams.
_ONE_TO_ONE_TAIL = (MapperIterDataPipe, FullSyncIterDataPipe, PrefetcherIterDataPipe)


def _is_one_to_one_tail(end: DataPipe, replicable: DataPipe) -> bool:
    """Whether the DataPipes of ``end``'s graph that stay in the main process (all but the
    replicable branch) hand on one item per item they take."""
    in_workers = {id(dp) for dp in list_dps(traverse_dps(replicable))}
    tail = [dp for dp in list_dps(traverse_dps(end)) if id(dp) not in in_workers]
    return all(isinstance(dp, _ONE_TO_ONE_TAIL) for dp in tail)


#: The default of the flat option keywords: "not given" (their group's value applies).
_UNSET: Any = object()

_Group = TypeVar("_Group", RestoreOptions, FaultOptions)


def _option_group(name: str, kind: Type[_Group], group: Optional[_Group], **flat: Any) -> _Group:
    """``group`` (or the defaults) with the flat keywords that were given applied to it."""
    if group is not None and not isinstance(group, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(group).__name__}")
    given = {key: value for key, value in flat.items() if value is not _UNSET}
    if group is not None and given:
        raise TypeError(
            f"give {', '.join(sorted(given))} either as keyword(s) or inside {name}={kind.__name__}(...), "
            "not both"
        )
    return kind(**given) if group is None else group


class MultiProcessingReadingService(
    upstream.MultiProcessingReadingService, CheckpointableReadingServiceInterface
):
    r"""Runs the replicable part of a ``DataPipe`` graph in worker processes; checkpointable mid-epoch.

    Same constructor and behaviour as ``torchdata.dataloader2.MultiProcessingReadingService``,
    plus :meth:`snapshot` (the RFC: one :class:`~torchdata_snapshot.WorkerSnapshot` per worker)
    and :meth:`checkpoint`/:meth:`restore`, through which ``DataLoader2.state_dict()``,
    ``DataLoader2.from_state()`` and ``DataLoader2.load_state_dict()`` resume an epoch exactly
    where the user stopped. Items move between processes in batches under credit-based flow
    control, without polling.

    Args:
        num_workers: number of worker processes; ``0`` runs the graph in the main process.
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (default: the
            platform's default).
        worker_prefetch_cnt: items each worker may produce ahead of the main process's requests.
        main_prefetch_cnt: items the main process asks for ahead of the user, spread over workers.
        worker_init_fn: called in each worker with ``(datapipe, WorkerInfo)`` when it starts.
        worker_reset_fn: called in each worker with ``(datapipe, WorkerInfo, SeedGenerator)`` at
            the start of every epoch.

    Keyword Args:
        batching: how workers group items into messages (:class:`BatchingOptions`).
        restore: how checkpoints are taken and restored (:class:`RestoreOptions`); its fields
            ``verify_replay``, ``state_interval`` and ``stateful`` may also be given as keywords.
        faults: bounds on waiting and self-healing (:class:`FaultOptions`); its fields
            ``control_timeout_s``, ``timeout_s`` and ``restart_dead_workers`` may also be given
            as keywords.
        isolate_rng: with ``num_workers=0``, give the pipeline its own ``random``/``torch``/``numpy``
            global RNG states (seeded by DataLoader2 like a worker's), so that the training loop's
            draws never change the data and a restored epoch replays exactly. Costs tens of
            microseconds per item; turn it off for in-process pipelines that use no global RNG.
    """

    def __init__(
        self,
        num_workers: int = 0,
        multiprocessing_context: Optional[str] = None,
        worker_prefetch_cnt: int = 10,
        main_prefetch_cnt: int = 10,
        worker_init_fn: Optional[Callable[[DataPipe, WorkerInfo], DataPipe]] = None,
        worker_reset_fn: Optional[Callable[[DataPipe, WorkerInfo, SeedGenerator], DataPipe]] = None,
        *,
        batching: BatchingOptions = BatchingOptions(),
        restore: Optional[RestoreOptions] = None,
        faults: Optional[FaultOptions] = None,
        isolate_rng: bool = True,
        verify_replay: bool = _UNSET,
        state_interval: int = _UNSET,
        stateful: Optional[bool] = _UNSET,
        control_timeout_s: float = _UNSET,
        timeout_s: Optional[float] = _UNSET,
        restart_dead_workers: int = _UNSET,
    ) -> None:
        # Upstream's __init__ is not called: it asserts instead of raising and warns that
        # num_workers=0 should use InProcessReadingService, which is not true here.
        self.num_workers = _check_count("num_workers", num_workers)
        if multiprocessing_context is not None and multiprocessing_context not in mp.get_all_start_methods():
            raise ValueError(
                f"multiprocessing_context must be one of {mp.get_all_start_methods()}, "
                f"got {multiprocessing_context!r}"
            )
        self.multiprocessing_context = multiprocessing_context
        self.worker_prefetch_cnt = _check_count("worker_prefetch_cnt", worker_prefetch_cnt)
        self.main_prefetch_cnt = _check_count("main_prefetch_cnt", main_prefetch_cnt)
        self.worker_init_fn = worker_init_fn
        self.worker_reset_fn = worker_reset_fn
        if not isinstance(batching, BatchingOptions):
            raise TypeError(f"batching must be a BatchingOptions, got {type(batching).__name__}")
        self.batching = batching
        self.restore_options = _option_group(
            "restore",
            RestoreOptions,
            restore,
            verify_replay=verify_replay,
            state_interval=state_interval,
            stateful=stateful,
        )
        self.fault_options = _option_group(
            "faults",
            FaultOptions,
            faults,
            control_timeout_s=control_timeout_s,
            timeout_s=timeout_s,
            restart_dead_workers=restart_dead_workers,
        )
        self.isolate_rng = bool(isolate_rng)
        self._mp = num_workers > 0
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        """Everything that only exists between ``initialize`` and ``finalize``."""
        self._worker_processes: List[Any] = []
        self._worker_graph: Any = None
        self._dispatch_process = None
        self._worker_datapipes: List[DataPipe] = []
        self._worker_consumer_datapipe: Optional[WorkerConsumer] = None
        self._dispatcher_channel: Optional[Channel] = None
        self._dispatcher_broken: Optional[str] = None
        self._main_prefetch_datapipe = None
        self._end_datapipe: Optional[Outlet] = None
        self._main_datapipes: List[DataPipe] = []
        self._epoch = NO_EPOCH
        self._epoch_seed: Optional[dict] = None  # SeedGenerator state at the start of the epoch
        self._fingerprint = ""
        self._pending_restore: Optional[Checkpoint] = None  # set by restore(), used by the next epoch
        self._paused = False
        self._initialized = False
        self._finalized = False

    # Upstream requires a reading service to be picklable before `initialize` (DataLoader2
    # clones it); the processes and pipes that exist afterwards are never pickled.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in list(state):
            if key.startswith("_"):
                del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._mp = self.num_workers > 0
        self._reset_runtime()

    # --- ReadingServiceInterface --------------------------------------------------------------

    def initialize(self, datapipe: DataPipe) -> DataPipe:
        if self._finalized:
            raise ReadingServiceClosedError("the reading service was shut down; create a new one")
        if self._initialized:
            raise ReadingServiceError("initialize() was already called on this reading service")
        self._fingerprint = graph_fingerprint(datapipe)
        if self._mp:
            end = self._start_workers(datapipe)
        else:
            end = process_init_fn(datapipe, WorkerInfo(1, 0), self.worker_init_fn)
        consumer = self._worker_consumer_datapipe
        outlet = Outlet(end, None if consumer is None else consumer.positions)
        outlet.verify = self.restore_options.verify_replay
        if consumer is None and self.isolate_rng:
            outlet.rng = IsolatedRNG()
        self._end_datapipe = outlet
        self._main_datapipes = [dp for _, dp in graph_datapipes(outlet)]
        self._initialized = True
        return outlet

    def _start_workers(self, datapipe: DataPipe) -> DataPipe:
        ctx: Any = mp.get_context(self.multiprocessing_context)
        graph = traverse_dps(datapipe)
        dispatcher_links: List[Optional[Channel]] = [None] * self.num_workers
        dispatching_dp = find_lca_round_robin_sharding_dp(graph)
        if dispatching_dp is not None:
            # The non-replicable part runs once, in the dispatching process; a placeholder
            # stands in the workers' graph where it was (replaced by DispatchedSource there).
            graph = replace_dp(graph, dispatching_dp, DispatchPlaceholder())
            datapipe = list(graph.values())[0][0]
        # The graph is checked before any process starts.
        replicable_dps = find_replicable_branches(graph)
        if len(replicable_dps) != 1:
            raise ValueError(
                "MultiProcessingReadingService needs exactly one replicable branch in the graph, "
                f"found {len(replicable_dps)}: {[type(dp).__name__ for dp in replicable_dps]}"
            )
        replicable_dp = replicable_dps[0]
        if self.fault_options.restart_dead_workers and dispatching_dp is not None:
            raise ValueError(
                "restart_dead_workers is not supported with sharding_round_robin_dispatch: a restarted "
                "worker would need the dispatched items of its stream again"
            )
        if dispatching_dp is not None:
            dispatcher_links = list(self._start_dispatcher(ctx, dispatching_dp))
        self._worker_graph = attach_wrapper(replicable_dp)
        channels: List[Channel] = []
        try:
            for worker_id in range(self.num_workers):
                self._worker_processes.append(None)
                channels.append(self._start_worker(ctx, worker_id, dispatcher_links[worker_id]))
        except BaseException:
            for channel in channels:
                channel.close()
            self._kill_processes(0.0)
            raise
        window = credit_window(self.num_workers, self.worker_prefetch_cnt, self.main_prefetch_cnt)
        faults = self.fault_options
        track = _is_one_to_one_tail(datapipe, replicable_dp)
        consumer = WorkerConsumer(
            channels,
            window,
            faults.control_timeout_s,
            faults.timeout_s,
            positions=UserPositions(self.num_workers) if track else None,
            respawn=functools.partial(self._restart_worker, ctx) if faults.restart_dead_workers else None,
            restarts_allowed=faults.restart_dead_workers,
        )
        self._worker_consumer_datapipe = consumer
        if replicable_dp is datapipe:
            return consumer
        replace_dp(graph, replicable_dp, consumer)
        return datapipe

    def _start_worker(self, ctx: Any, worker_id: int, dispatcher_link: Optional[Channel] = None) -> Channel:
        """Start worker ``worker_id`` (in ``_worker_processes[worker_id]``); return its channel."""
        options = WorkerOptions(
            custom_init_fn=self.worker_init_fn,
            custom_reset_fn=self.worker_reset_fn,
            batching=self.batching,
            restore=self.restore_options,
        )
        dispatcher_pid = None if self._dispatch_process is None else self._dispatch_process.pid
        channel, endpoint, child_ends = make_pipe_pair(ctx)
        info = WorkerInfo(self.num_workers, worker_id)
        process = ctx.Process(
            target=run_worker,
            args=(self._worker_graph, endpoint, info, os.getpid(), options, dispatcher_link, dispatcher_pid),
            name=f"torchdata_snapshot worker {worker_id}",
            daemon=True,
        )
        process.start()
        self._worker_processes[worker_id] = process
        for end in child_ends:
            end.close()  # so that the worker's death reads as end-of-file here
        if dispatcher_link is not None:
            dispatcher_link.close()  # the worker's end of its link to the dispatcher
        return channel.bind(f"worker {worker_id}", process, watch=self._check_dispatcher)

    def _restart_worker(self, ctx: Any, worker_id: int) -> Channel:
        """Self-healing: reap dead worker ``worker_id`` and start a fresh one in its place."""
        dead = self._worker_processes[worker_id]
        dead.join(JOIN_TIMEOUT_S)
        warnings.warn(
            f"worker {worker_id} (pid {dead.pid}) died ({describe_exit(dead.exitcode)}); restarting it "
            "and replaying its stream to where it stopped (restart_dead_workers)",
            RuntimeWarning,
            stacklevel=2,
        )
        return self._start_worker(ctx, worker_id)

    def _start_dispatcher(self, ctx: Any, dispatching_dp: DataPipe) -> List[Channel]:
        """Start the dispatching process; return, per worker, the worker's end of its link to it."""
        control, control_endpoint, control_child_ends = make_pipe_pair(ctx)
        links = [make_pipe_pair(ctx) for _ in range(self.num_workers)]
        process = ctx.Process(
            target=run_dispatcher,
            args=(
                attach_wrapper(dispatching_dp),
                control_endpoint,
                [endpoint for _, endpoint, _ in links],
                os.getpid(),
                self.batching,
                self.worker_reset_fn,
            ),
            name="torchdata_snapshot dispatcher",
            daemon=True,
        )
        process.start()
        for end in control_child_ends:
            end.close()
        for _, _, child_ends in links:
            for end in child_ends:
                end.close()
        self._dispatch_process = process
        self._dispatcher_channel = control.bind("dispatching process", process)
        return [channel for channel, _, _ in links]

    def _check_dispatcher(self) -> None:
        """Liveness check run by every wait on a worker: the worker may be waiting for the dispatcher."""
        process = self._dispatch_process
        if process is not None and process.exitcode is not None:
            how = describe_exit(process.exitcode)
            raise WorkerDiedError(f"dispatching process (pid {process.pid}) exited unexpectedly with {how}")

    def _ask_dispatcher(self, request: Any, expected: type) -> Any:
        """Send one control request to the dispatching process and return its answer."""
        channel = self._dispatcher_channel
        assert channel is not None
        try:
            channel.send(request)
            response = channel.recv(self.fault_options.control_timeout_s, what=expected.__name__)
        except BaseException as e:
            self._dispatcher_broken = f"{type(e).__name__} during {expected.__name__}"
            raise
        if isinstance(response, ErrorResponse):
            response.exc.reraise()
        if not isinstance(response, expected):
            raise ProtocolError(
                f"the dispatching process answered {type(response).__name__}, not {expected.__name__}"
            )
        return response

    def _broken(self) -> bool:
        consumer = self._worker_consumer_datapipe
        return self._dispatcher_broken is not None or (consumer is not None and consumer.broken is not None)

    @_shut_down_when_broken
    def initialize_iteration(
        self, seed_generator: SeedGenerator, iter_reset_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        self._check_open()
        outlet = self._end_datapipe
        assert outlet is not None, "initialize() must be called first"
        resume, self._pending_restore = self._pending_restore, None
        self._epoch += 1
        if resume is not None:
            # The generator DataLoader2 hands over was saved *after* this epoch's seeding (and
            # DistributedReadingService may have advanced it again): put it back, in place, to
            # where this epoch started, so that this epoch and every later one get the seeds
            # of the uninterrupted run.
            load_seed_state(seed_generator, resume.seed)
        self._epoch_seed = seed_state(seed_generator)
        advance_epoch_seed(seed_generator, self._epoch)
        consumer = self._worker_consumer_datapipe
        replay_in_main = resume is not None and resume.replay_in_main
        if consumer is not None:
            # The main process's DataPipes (the non-replicable tail) are seeded from the
            # generator itself, each worker from its spawn, as upstream.
            set_graph_random_seed(outlet, seed_generator)
            seeds = [seed_generator.spawn(worker_id) for worker_id in range(self.num_workers)]
            # Workers first: one of them may be waiting for a dispatched item of the old epoch.
            consumer.reset_epoch(self._epoch, seeds, iter_reset_fn)
            if self._dispatcher_channel is not None:
                self._ask_dispatcher(
                    ResetEpochRequest(self._epoch, seed_generator, iter_reset_fn), ResetEpochResponse
                )
            if resume is not None and not replay_in_main:
                consumer.replay(resume.workers, resume.next_worker)  # may need the dispatcher's new epoch
            consumer.start_epoch()
        elif outlet.rng is not None:
            # In-process, the graph is seeded like the only worker would be, global RNGs
            # included, but those are the pipeline's own (see IsolatedRNG).
            with outlet.rng.active():
                process_reset_fn(outlet, WorkerInfo(1, 0), seed_generator.spawn(0))
        else:
            set_graph_random_seed(outlet, seed_generator.spawn(0))
        if resume is None:
            outlet.start_epoch(self._epoch)
        elif replay_in_main:
            outlet.start_epoch(self._epoch, skip=resume.delivered, skip_digest=resume.digest)
        else:
            outlet.start_epoch(
                self._epoch,
                delivered=resume.delivered,
                worker_delivered=[w.delivered for w in resume.workers],
                last_worker=(resume.next_worker - 1) % self.num_workers if resume.delivered else -1,
            )
        return None

    def finalize_iteration(self) -> None:
        pass

    def finalize(self) -> None:
        """Stop every process and release the pipes. Idempotent, bounded.

        Healthy processes are asked to terminate and get ``min(JOIN_TIMEOUT_S,
        control_timeout_s)`` to exit; after a failure (a dead or stuck process, an interrupted
        exchange) the survivors are killed at once, there being nothing to say goodbye to.
        """
        if getattr(self, "_finalized", True):
            return
        self._finalized = True
        consumer = self._worker_consumer_datapipe
        graceful = consumer is None or consumer.request_terminate(timeout_s=self._join_timeout_s())
        if self._dispatcher_channel is not None:
            try:
                if not graceful or self._dispatcher_broken is not None:
                    raise ReadingServiceError("no graceful goodbye")
                self._ask_dispatcher(TerminateRequest(), TerminateResponse)
            except Exception:
                graceful = False
        self._kill_processes(self._join_timeout_s() if graceful else 0.0)
        if consumer is not None:
            consumer.close_channels()
        if self._dispatcher_channel is not None:
            self._dispatcher_channel.close()

    def _join_timeout_s(self) -> float:
        """How long shutdown waits for a process to answer and exit before killing it."""
        return min(JOIN_TIMEOUT_S, self.fault_options.control_timeout_s)

    def _kill_processes(self, wait_s: float) -> None:
        """Join every process within ``wait_s``, then kill those still alive (bounded)."""
        processes = [process for process in self._worker_processes if process is not None]
        if self._dispatch_process is not None:
            processes.append(self._dispatch_process)
        deadline = time.monotonic() + wait_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.exitcode is None:
                process.kill()
        for process in processes:
            process.join(JOIN_TIMEOUT_S)

    # --- checkpoint / restore -------------------------------------------------------------------

    def checkpoint(self) -> Dict[str, Any]:
        """The state ``DataLoader2.state_dict()`` stores: versioned plain data (see
        :mod:`torchdata_snapshot._checkpoint`).

        It describes what the *user* received: the epoch, its seeds, and per worker how many of
        its items reached the user. Taking it does not talk to the workers, does not pause
        anything and does not change the data; its size does not depend on the position.
        """
        self._check_open()
        outlet = self._end_datapipe
        workers: Tuple[WorkerPosition, ...] = (WorkerPosition(),) * self.num_workers
        if outlet is None or self._epoch < 0:
            return Checkpoint(
                self.num_workers, self._fingerprint, epoch=self._epoch, workers=workers
            ).to_plain()
        consumer = self._worker_consumer_datapipe
        next_worker = 0
        positions = outlet.positions
        if consumer is not None and positions is not None:
            workers = tuple(consumer.position(i, d) for i, d in enumerate(positions.delivered))
            next_worker = positions.next_worker
        return Checkpoint(
            num_workers=self.num_workers,
            fingerprint=self._fingerprint,
            epoch=self._epoch,
            status="finished" if outlet.finished else "in_epoch",
            seed=self._epoch_seed,
            delivered=outlet.delivered,
            replay_in_main=positions is None,
            digest=None if positions is not None else outlet.digest,
            workers=workers,
            next_worker=next_worker,
        ).to_plain()

    def restore(self, datapipe: DataPipe, serialized_state: Any) -> DataPipe:
        """Start the service for ``datapipe`` so that its next epoch resumes ``serialized_state``.

        The state is validated before any process starts
        (:class:`~torchdata_snapshot.InvalidCheckpointError`,
        :class:`~torchdata_snapshot.IncompatibleCheckpointError`). The epoch in progress restarts
        with its recorded seeds and each worker replays, inside its process, the items the user
        already received (from its latest captured graph state, when it has one).
        """
        if self._finalized:
            raise ReadingServiceClosedError("the reading service was shut down; create a new one")
        state = Checkpoint.from_plain(serialized_state)
        if state.num_workers != self.num_workers or state.status != "idle":
            state.check_fits(self.num_workers, graph_fingerprint(datapipe))
        end = self.initialize(datapipe)
        self._epoch = state.epoch - 1 if state.status == "in_epoch" else state.epoch
        self._pending_restore = state if state.status == "in_epoch" else None
        return end

    # --- pause / resume / limit (upstream semantics) ------------------------------------------

    @_shut_down_when_broken
    def _pause(
        self, pause_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        """Pause main-process DataPipes (prefetchers, ``fullsync``), then the workers."""
        self._check_open()
        for dp in pausable(self._main_datapipes):
            dp.pause()
        if self._worker_consumer_datapipe is not None:
            # Workers first: they finish their current item, which may need the dispatcher.
            self._worker_consumer_datapipe.request_pause(pause_fn)
        if self._dispatcher_channel is not None:
            self._ask_dispatcher(PauseRequest(pause_fn), PauseResponse)
        self._paused = True
        return None

    @_shut_down_when_broken
    def _resume(
        self, resume_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        self._check_open()
        if self._dispatcher_channel is not None:
            self._ask_dispatcher(ResumeRequest(resume_fn), ResumeResponse)
        if self._worker_consumer_datapipe is not None:
            self._worker_consumer_datapipe.request_resume(resume_fn)
        for dp in reversed(pausable(self._main_datapipes)):
            dp.resume()
        self._paused = False
        return None

    @_shut_down_when_broken
    def _limit(
        self,
        num_batches: Optional[int],
        limit_fn: Optional[Callable[[DataPipe, Optional[int]], DataPipe]] = None,
    ) -> Optional[Callable[[DataPipe, Optional[int]], DataPipe]]:
        if limit_fn is not None:
            self._check_open()
            consumer = self._worker_consumer_datapipe
            if self._dispatcher_channel is not None and consumer is not None:
                # As upstream: the limit only travels when a dispatching process exists, and
                # is split between the workers.
                per_worker = None
                if num_batches is not None:
                    share, rest = divmod(num_batches, self.num_workers)
                    per_worker = [share + (1 if i < rest else 0) for i in range(self.num_workers)]
                consumer.request_limit(num_batches, limit_fn, per_worker)
                self._ask_dispatcher(LimitRequest(num_batches, limit_fn), LimitResponse)
            elif consumer is not None:
                consumer.request_limit(None, limit_fn)
            limit_fn(self._end_datapipe, num_batches)
        return None

    # --- the RFC: snapshot --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._finalized:
            raise ReadingServiceClosedError(
                "the reading service was shut down (DataLoader2.shutdown() or finalize()); "
                "its workers are gone, so there is no state to report"
            )

    @_shut_down_when_broken
    def snapshot(self) -> List[WorkerSnapshot]:
        """One :class:`WorkerSnapshot` per worker, taken at one consistent point.

        Main-process DataPipes with their own threads are paused, every worker answers a
        ``GetStateRequest`` between two items, and the items the workers sent before answering
        are read into the main process's buffer, so that the counts add up (see
        :class:`WorkerSnapshot`). Nothing about the order of the data changes.
        With ``num_workers=0`` the single snapshot describes the in-process graph.
        """
        self._check_open()
        if not self._initialized:
            raise ReadingServiceError(
                "snapshot() needs a running reading service: create an iterator of the DataLoader2 first"
            )
        with paused([] if self._paused else pausable(self._main_datapipes)):
            if self._worker_consumer_datapipe is None:
                return [self._in_process_snapshot()]
            if self._dispatcher_channel is None:
                return self._worker_consumer_datapipe.request_snapshot()
            return self._snapshot_with_dispatcher()

    def _snapshot_with_dispatcher(self) -> List[WorkerSnapshot]:
        """Pause workers, then the dispatcher; take the dispatcher's state, then the workers'
        after they read what it had already sent; resume in reverse order."""
        consumer = self._worker_consumer_datapipe
        assert consumer is not None
        pause_here = not self._paused
        if pause_here:
            consumer.request_pause(None)
            self._ask_dispatcher(PauseRequest(), PauseResponse)
        try:
            dispatcher = self._ask_dispatcher(GetStateRequest(), GetStateResponse).snapshot
            workers = consumer.request_snapshot(dispatcher_sent=dispatcher.sent_per_worker)
        finally:
            if pause_here:
                self._ask_dispatcher(ResumeRequest(), ResumeResponse)
                consumer.request_resume(None)
        return [*workers, dispatcher]

    def _in_process_snapshot(self) -> WorkerSnapshot:
        assert self._end_datapipe is not None
        graph = graph_datapipes(self._end_datapipe)
        delivered = self._end_datapipe.delivered
        return WorkerSnapshot(
            worker_id=0,
            role="in_process",
            pid=os.getpid(),
            epoch=self._epoch,
            produced=delivered,
            sent=delivered,
            buffered=0,
            received=delivered,
            handed_on=delivered,
            exhausted=self._end_datapipe.finished,
            paused=self._paused,
            datapipe_yields=datapipe_yields(graph),
            datapipe_states=datapipe_state_dicts(graph),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_workers={self.num_workers}, "
            f"multiprocessing_context={self.multiprocessing_context!r}, "
            f"worker_prefetch_cnt={self.worker_prefetch_cnt}, main_prefetch_cnt={self.main_prefetch_cnt})"
        )
