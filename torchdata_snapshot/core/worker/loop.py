"""The worker loop: serves the requests of one channel and streams items under credit.

The loop's requests, their handlers and the counters they keep are described in
NOTE [ Snapshot protocol ] (:mod:`torchdata_snapshot.core.messages`).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, find_dps, replace_dp, traverse_dps
from torchdata.dataloader2.utils.worker import WorkerInfo, process_reset_fn

from torchdata_snapshot._compat import (
    DispatchPlaceholder,
    ExceptionWrapper,
    extract_wrapper,
    find_non_dispatching_branches,
    samples_yielded,
)
from torchdata_snapshot._constants import (
    LIVENESS_CHECK_INTERVAL_S,
    NO_EPOCH,
    REPLAY_HEARTBEAT_S,
    REQUEST_CHECK_ITEMS,
    REQUEST_CHECK_S,
)
from torchdata_snapshot._errors import ProtocolError, ReplayDivergenceError, StateCaptureError
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain, parse_chain_hex
from torchdata_snapshot.checkpoint.replay import replay
from torchdata_snapshot.core.graph import (
    datapipe_state_dicts,
    datapipe_yields,
    graph_datapipes,
    pausable,
    paused,
    sharding_point,
)
from torchdata_snapshot.core.messages import (
    ErrorResponse,
    GetNextRequest,
    GetStateRequest,
    GetStateResponse,
    ReplayProgressResponse,
    ReplayRequest,
    ReplayResponse,
    Request,
    ResetEpochRequest,
    ResetEpochResponse,
    Response,
    StateMarkResponse,
    StopIterationResponse,
    TerminateRequest,
    WorkerExceptionResponse,
)
from torchdata_snapshot.core.options import WorkerOptions
from torchdata_snapshot.core.plugins import ElasticWorker, installed
from torchdata_snapshot.core.serving import ServingLoop
from torchdata_snapshot.core.transport.batches import QueuedItem
from torchdata_snapshot.core.transport.channel import (
    Channel,
    Endpoint,
    ParentGone,
    ParentWatch,
    ignore_job_signals,
)
from torchdata_snapshot.core.transport.item_codec import ItemEncoder, ItemPool
from torchdata_snapshot.core.transport.outbox import Outbox
from torchdata_snapshot.core.worker.dispatcher import DispatchedSource, find_dispatched_sources
from torchdata_snapshot.graph_state.capture import CapturePacer
from torchdata_snapshot.graph_state.file_origins import check_opened, pack_opened
from torchdata_snapshot.graph_state.graph_state import GraphState
from torchdata_snapshot.graph_state.readers import StreamMaker
from torchdata_snapshot.graph_state.state_functions import (
    StateFunctions,
    check_state_functions_pickle,
    graph_state_functions,
)

__all__ = [
    "WorkerLoop",
    "carried_state_functions",
    "prepare_worker_graph",
    "run_worker",
]


class WorkerLoop(ServingLoop):
    """Serves one :class:`Endpoint` for the graph ``datapipe`` until ``TerminateRequest``.

    ``HANDLERS`` (below the class) is the one place that maps a request type to its handler.
    """

    def __init__(
        self,
        datapipe: DataPipe,
        endpoint: Endpoint,
        worker_info: WorkerInfo,
        *,
        name: Optional[str] = None,
        options: WorkerOptions = WorkerOptions(),
        distributed_shared_seed: bool = False,
        init_error: Optional[ExceptionWrapper] = None,
        state_functions: Sequence[StateFunctions] = (),
        pool: Optional[ItemPool] = None,
    ) -> None:
        self.datapipe = datapipe
        self.endpoint = endpoint
        self.worker_info = worker_info
        self.name = name or f"worker process {worker_info.worker_id}"
        self.options = options
        self.distributed_shared_seed = distributed_shared_seed
        self.init_error = init_error
        self.pool = pool  # where items' tensors travel (see torchdata_snapshot.tensor_pool.pool)
        self.encoder = ItemEncoder(pool)
        self.outbox = Outbox(endpoint, options.batching, self.name, None if pool is None else self._discard)
        self.epoch = NO_EPOCH
        self.iterator: Optional[Any] = None
        self.credit = 0
        self.produced = 0  # items the graph produced this epoch (== sent + pending in the outbox)
        # The running digest of the items produced this epoch (None: replay verification off).
        self.digest: Optional[int] = None
        self.exhausted = False
        self.paused = False
        self.terminated = False
        # Stateful restore (see torchdata_snapshot.graph_state.graph_state): capture the graph's
        # state from time to time when every DataPipe of the graph can resume from a state.
        self.stateful = False
        self.graph_state = GraphState(state_functions)
        self.pacer = CapturePacer(options.restore.max_items_between_captures, time.perf_counter)
        # Elastic resume's part, when its folder is there (see torchdata_snapshot.core.plugins).
        make_elastic = installed().elastic_worker
        self._elastic: Optional[ElasticWorker] = None if make_elastic is None else make_elastic()
        if self.init_error is None:
            try:
                self.datapipe, self.stateful = _maybe_resumable(datapipe, options, self.graph_state)
                if not self.stateful and self._elastic is not None:
                    self.datapipe = self._elastic.prepare(self.datapipe)
            except StateCaptureError:
                where = f"in {self.name} while preparing stateful restore"
                self.init_error = ExceptionWrapper(where=where)
        healthy = self.init_error is None
        self._graph: List[Tuple[str, DataPipe]] = graph_datapipes(self.datapipe) if healthy else []
        self._sources: List[DispatchedSource] = find_dispatched_sources(self.datapipe) if healthy else []
        # The sharding point whose position each item carries (see torchdata_snapshot.elastic.resume),
        # found at each epoch's reset (the reset function may replace DataPipes of the graph).
        self._sharding: Optional[ShardingFilterIterDataPipe] = None
        self._taken_before = 0  # graph_state.sharding.taken_before(self._sharding), once per iteration
        self._openers = self._find_openers()  # the graph's file openers (stateful graphs only)

    # --- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until ``TerminateRequest``, until the parent is gone or until the outbox broke."""
        try:
            while not self.terminated:
                if self._can_produce():
                    self._produce()
                    self._serve_pending()
                else:
                    request = self.endpoint.recv(LIVENESS_CHECK_INTERVAL_S)
                    if request is not None:
                        self._handle(request)
                    else:
                        self.outbox.check()  # idle: stop too if the outbox can no longer write
        except ParentGone:
            pass
        finally:
            self.iterator = None
            self.outbox.close()

    def run_until_idle(self) -> None:
        """Serve what is pending and produce what credit allows, then return instead of waiting.

        For in-process drivers (tests): after each request they send, the loop is run until it
        has nothing left to do and everything it sent is written, which makes every step
        deterministic.
        """
        while not self.terminated:
            if self._can_produce():
                self._produce()
            elif self.endpoint.poll():
                self._handle(self.endpoint.recv(timeout_s=None))
            else:
                break
        self.outbox.drain()

    def _serve_pending(self) -> None:
        while not self.terminated and self.endpoint.poll():
            self._handle(self.endpoint.recv(timeout_s=None))

    def _can_produce(self) -> bool:
        return self.iterator is not None and self.credit > 0 and not self.paused and not self.exhausted

    def _produce(self) -> None:
        """Produce items while credit lasts, handing each to the outbox as soon as it exists.

        Returns at least every ``REQUEST_CHECK_ITEMS`` items or ``REQUEST_CHECK_S`` seconds, so
        that requests (pause, state, reset) are served between items without a syscall per item.
        """
        self.pacer.start_producing()
        try:
            self._produce_some(time.perf_counter() + REQUEST_CHECK_S)
        finally:
            self.pacer.stop_producing()

    def _produce_some(self, deadline: float) -> None:
        for _ in range(REQUEST_CHECK_ITEMS):
            if self.credit <= 0:
                return
            try:
                item = next(self.iterator)  # type: ignore[arg-type]
            except StopIteration:
                self._end_stream(StopIterationResponse(self.epoch))
                return
            except Exception:
                self._end_stream(
                    WorkerExceptionResponse(ExceptionWrapper(where=f"in {self.name}"), epoch=self.epoch)
                )
                return
            try:
                payload = self.encoder.dumps(item)
            except Exception:
                where = f"in {self.name} while pickling item {self.produced} of epoch {self.epoch}"
                self._end_stream(WorkerExceptionResponse(ExceptionWrapper(where=where), epoch=self.epoch))
                return
            self.produced += 1
            self.credit -= 1
            if self.digest is not None:
                self.digest = chain(self.digest, item)
            taken = None if self._sharding is None else self._taken_before + samples_yielded(self._sharding)
            partial = None if self._elastic is None else self._elastic.partial()
            shared, slot = self.encoder.shared, self.encoder.slot
            opened = self._take_opened() if self._openers else None
            self.outbox.put_item(
                QueuedItem(self.epoch, payload, self.digest, shared, taken, partial, slot, opened)
            )
            if self.stateful and self.pacer.due(self.produced):
                self._capture_state()
            if time.perf_counter() >= deadline:
                return

    def _capture_state(self) -> None:
        """Send the graph's state after the item just produced (it travels behind that item);
        the pacer says when the next one is due (see :mod:`torchdata_snapshot.graph_state.capture`)."""
        start = time.thread_time()  # the capture's own cost, not waits for the GIL
        try:
            blob = self.graph_state.capture(self._graph)
        except StateCaptureError as e:
            # Checkpoints stay possible (by replay); the training run must not fail for this.
            warnings.warn(
                f"{self.name}: {e}; restores will replay this worker's stream", RuntimeWarning, stacklevel=2
            )
            self.stateful = False
            return
        self.outbox.put(StateMarkResponse(self.epoch, self.produced, blob))
        self.pacer.captured(self.produced, time.thread_time() - start)

    def _discard(self, item: QueuedItem) -> None:
        if item.slot is not None and self.pool is not None:
            self.pool.release(item.slot)  # it never reaches the main process, which would free it

    def _end_stream(self, response: Any) -> None:
        self.outbox.put(response)
        self.exhausted = True
        self.iterator = None

    def _handle(self, request: Request) -> None:
        if self.init_error is not None and not isinstance(request, TerminateRequest):
            self._reply(ErrorResponse(type(request).__name__, self.init_error))  # nothing else works
            return
        super()._handle(request)

    def _reply(self, response: Response) -> None:
        self.outbox.put(response)  # behind every item produced so far

    def _datapipes(self) -> List[DataPipe]:
        return [dp for _, dp in self._graph]

    def _find_sharding_point(self) -> Optional[ShardingFilterIterDataPipe]:
        return None if self._sources else sharding_point(self.datapipe)

    def _find_openers(self) -> List[StreamMaker]:
        return [dp for _, dp in self._graph if isinstance(dp, StreamMaker)]

    def _take_opened(self) -> Optional[bytes]:
        """The files the graph opened since the last call, packed to travel with an item."""
        opened = [origin for opener in self._openers for origin in opener.take_opened()]
        return pack_opened(opened) if opened else None

    # --- handlers -------------------------------------------------------------------------------

    def _on_reset_epoch(self, request: ResetEpochRequest) -> None:
        self.iterator = None
        self.graph_state.reset(self._graph)
        self.outbox.start_epoch(request.epoch)  # nothing of the previous epoch is sent after this
        self.datapipe = process_reset_fn(
            self.datapipe,
            self.worker_info,
            request.seed_generator,
            self.distributed_shared_seed,
            request.iter_reset_fn,
            self.options.custom_reset_fn,
        )
        self._sharding, self._taken_before = self._find_sharding_point(), 0
        if request.elastic is not None and (self._sharding is None or self._elastic is None):
            raise ProtocolError(f"{self.name}: an elastic epoch needs the graph's one sharding filter")
        if self._sharding is not None and self._elastic is not None:
            self._elastic.reset_epoch(
                self.datapipe, self._sharding, request.elastic, self.graph_state, self.stateful
            )
        self._graph = graph_datapipes(self.datapipe)
        self._openers = self._find_openers()
        self._take_opened()  # (of an epoch that is over)
        self.epoch = request.epoch
        for source in self._sources:
            source.reset_epoch(self.epoch)
        self.credit = self.produced = 0
        self.digest = CHAIN_START if self.options.restore.verify_replay else None
        self.pacer.start_epoch()
        self.exhausted = False
        self.iterator = iter(self.datapipe)
        self.outbox.put(ResetEpochResponse(self.epoch))

    def _on_replay(self, request: ReplayRequest) -> None:
        if request.epoch != self.epoch or self.produced or self.iterator is None:
            raise ProtocolError(
                f"{self.name}: a replay must directly follow the reset of epoch {request.epoch}"
            )
        check_opened(request.opened)  # files read again that no state names
        start = 0
        if request.state is not None:
            start, blob = request.state
            self.graph_state.load(self._graph, blob)
            self.iterator = iter(self.datapipe)  # starts from the loaded states
            if self._sharding is not None:
                self._taken_before = self.graph_state.sharding.taken_before(self._sharding)
            # The digest carries on from the state's position, if the checkpoint knows it there.
            known = self.digest is not None and request.state_digest is not None
            self.digest = parse_chain_hex(request.state_digest) if known else None  # type: ignore[arg-type]
        self._replay(start, request.skip, request.digest)
        self._take_opened()  # the main process has them: the request brought them
        self.pacer.replayed(self.produced)
        self.outbox.start_epoch(self.epoch, sent=self.produced)  # as if those had been sent
        self.outbox.put(ReplayResponse(self.epoch, request.skip))

    def _replay(self, start: int, skip: int, expected: Optional[str]) -> None:
        """Produce and drop items ``start + 1 .. start + skip``: the rest of what the user received
        before the checkpoint, after the state loaded at ``start`` (0: the epoch's beginning).
        They never leave this process; their running digest must end as ``expected``."""
        heartbeat = time.monotonic() + REPLAY_HEARTBEAT_S

        def progress(position: int) -> None:  # a long replay tells the main process it is alive
            nonlocal heartbeat
            if time.monotonic() >= heartbeat:
                self.outbox.put(ReplayProgressResponse(self.epoch, position))
                heartbeat = time.monotonic() + REPLAY_HEARTBEAT_S

        assert self.iterator is not None
        try:
            self.digest = replay(
                self.iterator, start, skip, self.digest, expected, where=self.name, epoch=self.epoch,
                on_item=progress,
            )  # fmt: skip
        except ReplayDivergenceError:
            self.iterator = None
            raise
        self.produced = start + skip

    def _on_get_next(self, request: GetNextRequest) -> None:
        if request.epoch == self.epoch:
            self.credit += request.count

    def _on_get_state(self, request: GetStateRequest) -> None:
        if request.dispatcher_sent is not None:
            for source in self._sources:  # the paused dispatcher's items still in flight
                source.drain_until(request.dispatcher_sent)
        self.outbox.put(GetStateResponse(self.snapshot(request.include_datapipe_states)))

    # --- state ----------------------------------------------------------------------------------

    def snapshot(self, include_datapipe_states: bool = True) -> WorkerSnapshot:
        """The worker's snapshot now; DataPipes with their own threads are paused around it."""
        sent, batches = self.outbox.counters()
        with paused([] if self.paused else pausable(dp for _, dp in self._graph)):
            states = datapipe_state_dicts(self._graph) if include_datapipe_states else {}
            yields = datapipe_yields(self._graph)
        return WorkerSnapshot(
            worker_id=self.worker_info.worker_id,
            role="worker",
            pid=os.getpid(),
            epoch=self.epoch,
            produced=self.produced,
            sent=sent,
            batches=batches,
            buffered=self.produced - sent,
            exhausted=self.exhausted,
            paused=self.paused,
            datapipe_yields=yields,
            datapipe_states=states,
            stateful=self.stateful,
            received_from_dispatcher=sum(source.received for source in self._sources),
        )


WorkerLoop.HANDLERS = {
    **ServingLoop.HANDLERS,
    ResetEpochRequest: "_on_reset_epoch",
    ReplayRequest: "_on_replay",
    GetNextRequest: "_on_get_next",
    GetStateRequest: "_on_get_state",
}


def prepare_worker_graph(
    datapipe: DataPipe,
    worker_info: WorkerInfo,
    options: WorkerOptions,
    dispatcher_link: Optional[Channel] = None,
) -> DataPipe:
    """Shard the replicable graph for this worker and apply ``worker_init_fn`` (upstream semantics).

    With a dispatching process, the placeholder where the dispatched part was becomes a
    :class:`DispatchedSource` reading ``dispatcher_link``, and only the branches that do not
    come from it are sharded.
    """
    graph = traverse_dps(datapipe)
    placeholders = find_dps(graph, DispatchPlaceholder)
    if not placeholders:
        torch.utils.data.graph_settings.apply_sharding(
            datapipe, worker_info.num_workers, worker_info.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
        )
    else:
        if len(placeholders) != 1 or dispatcher_link is None:
            raise ProtocolError(
                "a worker graph with a dispatched part needs exactly one link to the dispatcher"
            )
        for branch in find_non_dispatching_branches(graph):
            torch.utils.data.graph_settings.apply_sharding(
                branch, worker_info.num_workers, worker_info.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
            )
        graph = replace_dp(graph, placeholders[0], DispatchedSource(dispatcher_link))
        datapipe = list(graph.values())[0][0]
    if options.custom_init_fn is not None:
        datapipe = options.custom_init_fn(datapipe, worker_info)
    return datapipe


def _captures_states(options: WorkerOptions) -> bool:
    """Whether the options let a worker capture its graph's state (when the graph allows it)."""
    return options.restore.stateful is not False


def carried_state_functions(
    datapipe: DataPipe, options: WorkerOptions, start_method: str
) -> Tuple[StateFunctions, ...]:
    """The registered state functions that the workers of ``datapipe`` need (none when they
    capture no state), for :func:`run_worker`: a worker started by ``spawn`` or ``forkserver``
    does not run the code that registered them. Raises :class:`StateCaptureError` naming one
    that cannot reach such a worker."""
    if not _captures_states(options):
        return ()
    carried = graph_state_functions(datapipe)
    if start_method != "fork":  # forked workers inherit them; the others unpickle them
        check_state_functions_pickle(carried, start_method)
    return carried


def _maybe_resumable(
    datapipe: DataPipe, options: WorkerOptions, graph_state: GraphState
) -> Tuple[DataPipe, bool]:
    """The graph rewritten for stateful restore when it allows it (and the options do), and
    whether it was."""
    restore = options.restore
    if not _captures_states(options):
        return datapipe, False
    if find_dispatched_sources(datapipe):
        if restore.stateful:
            raise StateCaptureError(
                "stateful=True is not available with sharding_round_robin_dispatch: the dispatching "
                "process is restored by replay only; use stateful=None (or False)"
            )
        return datapipe, False
    culprit = graph_state.unresumable(datapipe)
    if culprit is None:
        return graph_state.make_resumable(datapipe), True
    if restore.stateful:
        raise StateCaptureError(
            f"stateful=True, but DataPipe {culprit} can neither report nor load its state: implement "
            "state_dict()/load_state_dict() or call torchdata_snapshot.register_state_functions()"
        )
    return datapipe, False


def run_worker(
    datapipe: DataPipe,
    endpoint: Endpoint,
    worker_info: WorkerInfo,
    parent_pid: int,
    options: WorkerOptions,
    dispatcher_link: Optional[Channel] = None,
    dispatcher_pid: Optional[int] = None,
    state_functions: Sequence[StateFunctions] = (),
    pool: Optional[ItemPool] = None,
) -> None:
    """Entry point of a worker process; ``state_functions`` are those of
    :func:`carried_state_functions`."""
    if pool is not None:
        pool.close_fd()  # (inherited under fork) the mapping keeps the memory
    torch.set_num_threads(1)
    ignore_job_signals()
    endpoint.parent = ParentWatch(parent_pid)
    if dispatcher_link is not None:
        dispatcher_link.bind("dispatching process", watch=endpoint.check_parent, pid=dispatcher_pid)
    init_error = None
    try:
        datapipe = prepare_worker_graph(extract_wrapper(datapipe), worker_info, options, dispatcher_link)
    except Exception:
        init_error = ExceptionWrapper(
            where=f"in worker process {worker_info.worker_id} while initializing it"
        )
    loop = WorkerLoop(
        datapipe,
        endpoint,
        worker_info,
        options=options,
        init_error=init_error,
        state_functions=state_functions,
        pool=pool,
    )
    try:
        loop.run()
    finally:
        endpoint.close()
