"""The worker loop: serves the requests of one channel and streams items under credit.

The loop's requests, their handlers and the counters they keep are described in
NOTE [ Snapshot protocol ] (:mod:`torchdata_snapshot.core.messages`).
"""

from __future__ import annotations

import os
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.graph._serialization import extract_wrapper
from torchdata.dataloader2.utils.worker import WorkerInfo, process_reset_fn

from torchdata_snapshot._constants import (
    LIVENESS_CHECK_INTERVAL_S,
    REPLAY_HEARTBEAT_S,
    REQUEST_CHECK_ITEMS,
    REQUEST_CHECK_S,
)
from torchdata_snapshot._errors import (
    ExceptionWrapper,
    ProtocolError,
    ReplayDivergenceError,
    StateCaptureError,
)
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
)
from torchdata_snapshot.core.transport.item_codec import ItemEncoder, ItemPool
from torchdata_snapshot.core.transport.outbox import Outbox
from torchdata_snapshot.core.worker.dispatcher import DispatchedSource, find_dispatched_sources
from torchdata_snapshot.core.worker.epoch import WorkerEpoch
from torchdata_snapshot.core.worker.signals import ignore_job_signals
from torchdata_snapshot.core.worker.worker_graph import prepare_worker_graph
from torchdata_snapshot.graph_state.file_origins import check_opened
from torchdata_snapshot.graph_state.state_functions import (
    StateFunctions,
)
from torchdata_snapshot.graph_state.worker_states import WorkerStates

__all__ = [
    "WorkerLoop",
    "run_worker",
]


class WorkerLoop(ServingLoop):
    """Serves one :class:`Endpoint` for the graph ``datapipe`` until ``TerminateRequest``.

    ``HANDLERS`` (below the class) is the one place that maps a request type to its handler.
    What the epoch in progress has done is ``self.current`` (a :class:`WorkerEpoch`, new at each
    reset); the graph's states for stateful restore are ``self.states``'.
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
        self.current = WorkerEpoch()
        self.paused = False
        self.terminated = False
        self.states = WorkerStates(options, state_functions, self.name)
        # Elastic resume's part, when its folder is there (see torchdata_snapshot.core.plugins).
        make_elastic = installed().elastic_worker
        self._elastic: Optional[ElasticWorker] = None if make_elastic is None else make_elastic()
        if self.init_error is None:
            try:
                self.datapipe = self.states.prepare(datapipe, bool(find_dispatched_sources(datapipe)))
                if not self.states.stateful and self._elastic is not None:
                    self.datapipe = self._elastic.prepare(self.datapipe)
            except StateCaptureError:
                where = f"in {self.name} while preparing stateful restore"
                self.init_error = ExceptionWrapper(where=where)
        healthy = self.init_error is None
        self._graph: List[Tuple[str, DataPipe]] = graph_datapipes(self.datapipe) if healthy else []
        self._sources: List[DispatchedSource] = find_dispatched_sources(self.datapipe) if healthy else []

    @property
    def iterator(self) -> Optional[Any]:
        return self.current.iterator

    @iterator.setter
    def iterator(self, value: Optional[Any]) -> None:
        self.current.iterator = value

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
        return not self.paused and self.current.can_produce()

    def _produce(self) -> None:
        """Produce items while credit lasts, handing each to the outbox as soon as it exists.

        Returns at least every ``REQUEST_CHECK_ITEMS`` items or ``REQUEST_CHECK_S`` seconds, so
        that requests (pause, state, reset) are served between items without a syscall per item.
        """
        self.states.pacer.start_producing()
        try:
            self._produce_some(self.current, time.perf_counter() + REQUEST_CHECK_S)
        finally:
            self.states.pacer.stop_producing()

    def _produce_some(self, epoch: WorkerEpoch, deadline: float) -> None:
        for _ in range(REQUEST_CHECK_ITEMS):
            if epoch.credit <= 0:
                return
            try:
                item = next(epoch.iterator)  # type: ignore[arg-type]
            except StopIteration:
                self._end_stream(StopIterationResponse(epoch.number))
                return
            except Exception:
                self._end_stream(
                    WorkerExceptionResponse(ExceptionWrapper(where=f"in {self.name}"), epoch=epoch.number)
                )
                return
            try:
                payload = self.encoder.dumps(item)
            except Exception:
                where = f"in {self.name} while pickling item {epoch.produced} of epoch {epoch.number}"
                self._end_stream(WorkerExceptionResponse(ExceptionWrapper(where=where), epoch=epoch.number))
                return
            epoch.produced += 1
            epoch.credit -= 1
            if epoch.digest is not None:
                epoch.digest = chain(epoch.digest, item)
            partial = None if self._elastic is None else self._elastic.partial()
            opened = self.states.take_opened() if self.states.reads_files else None
            self.outbox.put_item(
                QueuedItem(
                    epoch.number, payload, epoch.digest, self.encoder.shared, epoch.taken(), partial,
                    self.encoder.slot, opened,
                )
            )  # fmt: skip
            if self.states.capture_due(epoch.produced):
                self._capture_state(epoch)
            if time.perf_counter() >= deadline:
                return

    def _capture_state(self, epoch: WorkerEpoch) -> None:
        """Send the graph's state after the item just produced (it travels behind that item);
        the pacer says when the next one is due (see :mod:`torchdata_snapshot.graph_state.capture`)."""
        blob = self.states.capture(self._graph, epoch.produced)
        if blob is not None:
            self.outbox.put(StateMarkResponse(epoch.number, epoch.produced, blob))

    def _discard(self, item: QueuedItem) -> None:
        if item.slot is not None and self.pool is not None:
            self.pool.release(item.slot)  # it never reaches the main process, which would free it

    def _end_stream(self, response: Any) -> None:
        self.outbox.put(response)
        self.current.end()

    def _handle(self, request: Request) -> None:
        if self.init_error is not None and not isinstance(request, TerminateRequest):
            self._reply(ErrorResponse(type(request).__name__, self.init_error))  # nothing else works
            return
        super()._handle(request)

    def _reply(self, response: Response) -> None:
        self.outbox.put(response)  # behind every item produced so far

    def _datapipes(self) -> List[DataPipe]:
        return [dp for _, dp in self._graph]

    # --- handlers -------------------------------------------------------------------------------

    def _on_reset_epoch(self, request: ResetEpochRequest) -> None:
        self.iterator = None
        self.states.end_epoch(self._graph)
        self.outbox.start_epoch(request.epoch)  # nothing of the previous epoch is sent after this
        self.datapipe = process_reset_fn(
            self.datapipe,
            self.worker_info,
            request.seed_generator,
            self.distributed_shared_seed,
            request.iter_reset_fn,
            self.options.custom_reset_fn,
        )
        # The reset function may have replaced DataPipes: the graph and its sharding point anew.
        sharding = None if self._sources else sharding_point(self.datapipe)
        if request.elastic is not None and (sharding is None or self._elastic is None):
            raise ProtocolError(f"{self.name}: an elastic epoch needs the graph's one sharding filter")
        if sharding is not None and self._elastic is not None:
            self._elastic.reset_epoch(
                self.datapipe, sharding, request.elastic, self.states.graph_state, self.states.stateful
            )
        self._graph = graph_datapipes(self.datapipe)
        self.states.start_epoch(self._graph)
        for source in self._sources:
            source.reset_epoch(request.epoch)
        digest = CHAIN_START if self.options.restore.verify_replay else None
        self.current = WorkerEpoch(request.epoch, iter(self.datapipe), digest=digest, sharding=sharding)
        self.outbox.put(ResetEpochResponse(request.epoch))

    def _on_replay(self, request: ReplayRequest) -> None:
        epoch = self.current
        if request.epoch != epoch.number or epoch.produced or epoch.iterator is None:
            raise ProtocolError(
                f"{self.name}: a replay must directly follow the reset of epoch {request.epoch}"
            )
        check_opened(request.opened)  # files read again that no state names
        start = 0
        if request.state is not None:
            start, blob = request.state
            epoch.taken_before = self.states.load(self._graph, blob, epoch.sharding)
            epoch.iterator = iter(self.datapipe)  # starts from the loaded states
            # The digest carries on from the state's position, if the checkpoint knows it there.
            known = epoch.digest is not None and request.state_digest is not None
            epoch.digest = parse_chain_hex(request.state_digest) if known else None  # type: ignore[arg-type]
        self._replay(epoch, start, request.skip, request.digest)
        self.states.take_opened()  # the main process has them: the request brought them
        self.states.pacer.replayed(epoch.produced)
        self.outbox.start_epoch(epoch.number, sent=epoch.produced)  # as if those had been sent
        self.outbox.put(ReplayResponse(epoch.number, request.skip))

    def _replay(self, epoch: WorkerEpoch, start: int, skip: int, expected: Optional[str]) -> None:
        """Produce and drop items ``start + 1 .. start + skip``: the rest of what the user received
        before the checkpoint, after the state loaded at ``start`` (0: the epoch's beginning).
        They never leave this process; their running digest must end as ``expected``."""
        heartbeat = time.monotonic() + REPLAY_HEARTBEAT_S

        def progress(position: int) -> None:  # a long replay tells the main process it is alive
            nonlocal heartbeat
            if time.monotonic() >= heartbeat:
                self.outbox.put(ReplayProgressResponse(epoch.number, position))
                heartbeat = time.monotonic() + REPLAY_HEARTBEAT_S

        assert epoch.iterator is not None
        try:
            epoch.digest = replay(
                epoch.iterator, start, skip, epoch.digest, expected, where=self.name, epoch=epoch.number,
                on_item=progress,
            )  # fmt: skip
        except ReplayDivergenceError:
            epoch.iterator = None
            raise
        epoch.produced = start + skip

    def _on_get_next(self, request: GetNextRequest) -> None:
        if request.epoch == self.current.number:
            self.current.credit += request.count

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
        epoch = self.current
        return WorkerSnapshot(
            worker_id=self.worker_info.worker_id,
            role="worker",
            pid=os.getpid(),
            epoch=epoch.number,
            produced=epoch.produced,
            sent=sent,
            batches=batches,
            buffered=epoch.produced - sent,
            exhausted=epoch.exhausted,
            paused=self.paused,
            datapipe_yields=yields,
            datapipe_states=states,
            stateful=self.states.stateful,
            received_from_dispatcher=sum(source.received for source in self._sources),
        )


WorkerLoop.HANDLERS = {
    **ServingLoop.HANDLERS,
    ResetEpochRequest: "_on_reset_epoch",
    ReplayRequest: "_on_replay",
    GetNextRequest: "_on_get_next",
    GetStateRequest: "_on_get_state",
}


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
    :func:`~torchdata_snapshot.graph_state.worker_states.carried_state_functions`."""
    if pool is not None:
        pool.close_fd()  # (inherited under fork) the mapping keeps the memory
    torch.set_num_threads(1)
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
