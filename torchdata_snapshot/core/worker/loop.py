"""The worker loop: serves the requests of one channel and streams items under credit.

The loop's requests, their handlers and the counters they keep are described in
NOTE [ Snapshot protocol ] (:mod:`torchdata_snapshot.core.messages`). This loop knows nothing of
checkpoints: restore by replay (:mod:`torchdata_snapshot.checkpoint.worker_loop`) and from captured
states (:mod:`torchdata_snapshot.graph_state.worker_loop`) extend it at its hooks (``_prepare``,
``_queued``, ``_after_item``, ``_end_epoch``, ``_start_epoch``); a worker process runs the most
capable loop installed (:mod:`torchdata_snapshot.core.worker.entry`).
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._compat.datapipes import answer_child_checks
from torchdata_snapshot._constants import LIVENESS_CHECK_INTERVAL_S, REQUEST_CHECK_ITEMS, REQUEST_CHECK_S
from torchdata_snapshot._errors import ExceptionWrapper
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
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
    Request,
    ResetEpochRequest,
    ResetEpochResponse,
    Response,
    StopIterationResponse,
    TerminateRequest,
    WorkerExceptionResponse,
)
from torchdata_snapshot.core.options import WorkerOptions
from torchdata_snapshot.core.serving import ServingLoop
from torchdata_snapshot.core.transport.batches import QueuedItem
from torchdata_snapshot.core.transport.channel import Endpoint, ParentGone
from torchdata_snapshot.core.transport.item_codec import ItemEncoder, ItemPool
from torchdata_snapshot.core.transport.outbox import Outbox
from torchdata_snapshot.core.traversal import reset_graph, traverse
from torchdata_snapshot.core.worker.dispatcher import DispatchedSource, find_dispatched_sources
from torchdata_snapshot.core.worker.epoch import WorkerEpoch

__all__ = ["WorkerLoop"]


class WorkerLoop(ServingLoop):
    """Serves one :class:`Endpoint` for the graph ``datapipe`` until ``TerminateRequest``.

    ``HANDLERS`` (below the class) is the one place that maps a request type to its handler; a
    subclass extends it. What the epoch in progress has done is ``self.current`` (a
    :class:`WorkerEpoch`, new at each reset).
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
        self.serving_since: Optional[float] = None  # set as run() begins
        self.paused = False
        self.terminated = False
        if self.init_error is None:
            self.datapipe = self._prepare(datapipe)
        graph = traverse(self.datapipe) if self.init_error is None else {}
        self._graph: List[Tuple[str, DataPipe]] = graph_datapipes(self.datapipe, graph) if graph else []
        self._sources: List[DispatchedSource] = find_dispatched_sources(self.datapipe, graph) if graph else []

    @property
    def iterator(self) -> Optional[Any]:
        return self.current.iterator

    @iterator.setter
    def iterator(self, value: Optional[Any]) -> None:
        self.current.iterator = value

    # --- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until ``TerminateRequest``, until the parent is gone or until the outbox broke."""
        self.serving_since = time.time()
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
        self._produce_some(self.current, time.perf_counter() + REQUEST_CHECK_S)

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
            self.outbox.put(self._queued(epoch, item, payload))
            self._after_item(epoch)
            if time.perf_counter() >= deadline:
                return

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

    # --- what a subclass extends ----------------------------------------------------------------

    #: Whether this loop restores a graph from its captured states (``stateful=True`` needs one).
    CAPTURES_STATES: ClassVar[bool] = False

    @classmethod
    def carried_arguments(
        cls, datapipe: DataPipe, options: WorkerOptions, start_method: str
    ) -> Dict[str, Any]:
        """The keyword arguments of this loop's own that a worker running ``datapipe`` gets from
        the main process, which calls this before starting workers with ``start_method``."""
        return {}

    def _prepare(self, datapipe: DataPipe) -> DataPipe:
        """The graph this loop runs, made from the worker's graph once, before the first epoch
        (a failure to report sets ``self.init_error``: every request is then answered with it)."""
        return datapipe

    def _queued(self, epoch: WorkerEpoch, item: Any, payload: bytes) -> QueuedItem:
        """The item just produced (``epoch.produced`` counts it), as the outbox sends it."""
        return QueuedItem(epoch.number, payload, shared=self.encoder.shared, slot=self.encoder.slot)

    def _after_item(self, epoch: WorkerEpoch) -> None:
        """After an item was handed to the outbox: what must travel right behind it."""

    def _end_epoch(self) -> None:
        """Before the reset of the next epoch, on the graph of the one that ends."""

    def _start_epoch(self, request: ResetEpochRequest, epoch: WorkerEpoch) -> None:
        """After the reset: ``epoch`` (not started; the graph is ``self._graph``, listed again by
        a subclass that changes it) is about to be the current one."""

    @property
    def stateful(self) -> bool:
        """Whether this worker's graph resumes from captured states (what its snapshot reports)."""
        return False

    # --- handlers -------------------------------------------------------------------------------

    def _on_reset_epoch(self, request: ResetEpochRequest) -> None:
        self.iterator = None
        self._end_epoch()
        self.outbox.start_epoch(request.epoch)  # nothing of the previous epoch is sent after this
        # One traversal for the epoch: the reset functions may have replaced DataPipes, and the
        # graph, its keys and its sharding point are what the epoch runs.
        self.datapipe, graph = reset_graph(
            self.datapipe,
            self.worker_info,
            request.seed_generator,
            self.distributed_shared_seed,
            request.iter_reset_fn,
            self.options.custom_reset_fn,
        )
        sharding = None if self._sources else sharding_point(self.datapipe, graph)
        self._graph = graph_datapipes(self.datapipe, graph)
        epoch = WorkerEpoch(request.epoch, sharding=sharding, graph=graph)
        self._start_epoch(request, epoch)
        for source in self._sources:
            source.reset_epoch(request.epoch)
        answer_child_checks(self._datapipes())  # (the graph as the epoch runs it)
        epoch.iterator = iter(self.datapipe)
        self.current = epoch
        self.outbox.put(ResetEpochResponse(request.epoch, serving_since=self.serving_since))

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
            stateful=self.stateful,
            received_from_dispatcher=sum(source.received for source in self._sources),
        )


WorkerLoop.HANDLERS = {
    **ServingLoop.HANDLERS,
    ResetEpochRequest: "_on_reset_epoch",
    GetNextRequest: "_on_get_next",
    GetStateRequest: "_on_get_state",
}
