"""The dispatching process (``sharding_round_robin_dispatch``) and its source in each worker.

DataLoader2 runs the non-replicable part of the graph in one dispatching process and splits it
with ``round_robin_demux`` into one loop per worker, polled with ``time.sleep(0)``. Here
:class:`DispatcherLoop` iterates that part once and hands item ``j`` to worker ``j % N``,
so each worker's input is a deterministic function of the seed. Workers grant credit
(``GetNextRequest``) and receive ``ItemsResponse`` batches, as between workers and the main
process; the loop blocks in ``wait`` on all its pipes instead of polling.

The main process drives the dispatcher through a control pipe: ``ResetEpochRequest`` before
the workers are reset, ``PauseRequest`` (answered with the dispatcher's snapshot) and
``ResumeRequest`` around a consistent snapshot, ``LimitRequest``, ``TerminateRequest``.

In a worker, :class:`DispatchedSource` replaces the placeholder where the dispatched part
was. It reads its pipe only when its graph needs an item, drops anything of an older epoch,
and turns the dispatcher's end of stream or exception into its own.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, cast

import torch
from torch.utils.data import IterDataPipe
from torchdata.dataloader2.graph import DataPipe, DataPipeGraph, find_dps
from torchdata.dataloader2.graph._serialization import extract_wrapper
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._compat.datapipes import answer_child_checks
from torchdata_snapshot._constants import (
    DISPATCH_WINDOW,
    DISPATCHER_ID,
    LIVENESS_CHECK_INTERVAL_S,
    MAX_PENDING_PER_WORKER,
    NO_EPOCH,
)
from torchdata_snapshot._errors import ExceptionWrapper, ProtocolError, ReadingServiceError
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.graph import datapipe_state_dicts, datapipe_yields, graph_datapipes
from torchdata_snapshot.core.messages import (
    ErrorResponse,
    GetNextRequest,
    GetStateRequest,
    GetStateResponse,
    PauseResponse,
    ResetEpochRequest,
    ResetEpochResponse,
    Response,
    StopIterationResponse,
    WorkerExceptionResponse,
)
from torchdata_snapshot.core.options import BatchingOptions
from torchdata_snapshot.core.serving import ServingLoop
from torchdata_snapshot.core.transport.batches import (
    END,
    Credit,
    QueuedItem,
    Raised,
    file_response,
    items_message,
    take_batch,
)
from torchdata_snapshot.core.transport.channel import (
    Channel,
    Endpoint,
    ParentGone,
    ParentWatch,
    wait_any,
)
from torchdata_snapshot.core.transport.item_codec import ItemEncoder
from torchdata_snapshot.core.traversal import reset_graph, traverse
from torchdata_snapshot.core.worker.signals import ignore_job_signals

__all__ = [
    "DispatchedSource",
    "DispatcherLoop",
    "run_dispatcher",
]


class DispatcherLoop(ServingLoop):
    """Serves the control channel (main process) and one channel per worker.

    Counters for the current epoch: ``produced`` items taken from the graph, ``sent[w]`` items
    sent to worker ``w``; always ``produced == sum(sent) + sum(len(pending))``.
    """

    name = "dispatching process"

    def __init__(
        self,
        datapipe: DataPipe,
        control: Endpoint,
        workers: Sequence[Endpoint],
        *,
        batching: BatchingOptions = BatchingOptions(),
        custom_reset_fn: Optional[Callable[..., DataPipe]] = None,
        max_pending: int = MAX_PENDING_PER_WORKER,
    ) -> None:
        self.datapipe = datapipe
        self.control = control
        self.workers = list(workers)
        self.num_workers = len(self.workers)
        self.batching = batching
        self.custom_reset_fn = custom_reset_fn
        self.max_pending = max_pending
        self.worker_info = WorkerInfo(self.num_workers, 0)
        self.epoch = NO_EPOCH
        self.iterator: Optional[Iterator[Any]] = None
        self.produced = 0
        self.credit = [0] * self.num_workers
        self.sent = [0] * self.num_workers
        self.pending: List[Deque[Any]] = [deque() for _ in self.workers]
        self.end_sent = [True] * self.num_workers
        self.encoder = ItemEncoder()
        self.ended: Optional[Any] = None  # END or an ExceptionWrapper once the graph stopped
        self.paused = False
        self.terminated = False

    # --- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self.terminated:
                self._serve_ready(timeout_s=0 if self._has_work() else LIVENESS_CHECK_INTERVAL_S)
                if self.terminated:
                    break
                self._produce()
                self._send()
        except ParentGone:
            pass
        finally:
            self.iterator = None

    def _serve_ready(self, timeout_s: float) -> None:
        ready = wait_any([self.control, *self.workers], timeout_s)
        if not ready:
            if timeout_s:
                self.control.check_parent()
            return
        for channel in ready:
            request = channel.recv(timeout_s=0)
            if request is None:
                continue
            if channel is self.control:
                self._handle(request)
            else:
                self._on_worker_request(self.workers.index(channel), request)

    def _demand(self) -> bool:
        return any(self.credit[w] > len(self.pending[w]) for w in range(self.num_workers))

    def _has_work(self) -> bool:
        if self.paused or self.iterator is None:
            return False
        sendable = any(
            (self.credit[w] and self.pending[w])
            or (self.ended is not None and not self.pending[w] and not self.end_sent[w])
            for w in range(self.num_workers)
        )
        return sendable or (self.ended is None and self._demand())

    def _produce(self) -> None:
        """Produce items, round-robin, while some worker has credit it cannot use yet."""
        if self.paused or self.iterator is None or self.ended is not None:
            return
        start = time.perf_counter()
        while self._demand():
            target = self.produced % self.num_workers
            if len(self.pending[target]) >= self.max_pending:
                error = ReadingServiceError(
                    f"the dispatching process holds {self.max_pending} items for worker {target} "
                    "that it does not ask for: the workers consume the dispatched items very "
                    "unevenly (a filter after sharding_round_robin_dispatch?)"
                )
                self.ended = ExceptionWrapper((type(error), error, None), where="in dispatching process")
                return
            try:
                item = next(self.iterator)
            except StopIteration:
                self.ended = END
                return
            except Exception:
                self.ended = ExceptionWrapper(where="in dispatching process")
                return
            self.pending[target].append(QueuedItem(self.epoch, self.encoder.dumps(item)))
            self.produced += 1
            if time.perf_counter() - start >= self.batching.max_delay_s:
                return

    def _send(self) -> None:
        if self.paused or self.iterator is None:
            return
        for w, channel in enumerate(self.workers):
            pending = self.pending[w]
            while self.credit[w] and pending:
                limit = min(self.credit[w], self.batching.max_items)
                batch = take_batch(pending, limit, self.batching.max_bytes)
                channel.send(items_message(batch))
                self.credit[w] -= len(batch)
                self.sent[w] += len(batch)
            if self.ended is not None and not pending and not self.end_sent[w]:
                if self.ended is END:
                    channel.send(StopIterationResponse(self.epoch))
                else:
                    channel.send(WorkerExceptionResponse(self.ended, epoch=self.epoch))
                self.end_sent[w] = True

    def _on_worker_request(self, worker_id: int, request: Any) -> None:
        if isinstance(request, GetNextRequest):
            if request.epoch == self.epoch:
                self.credit[worker_id] += request.count
            return
        name = type(request).__name__
        error = ProtocolError(f"the dispatching process does not serve {name!r} from workers")
        wrapped = ExceptionWrapper((type(error), error, None), where="in dispatching process")
        self.workers[worker_id].send(ErrorResponse(name, wrapped))

    def _reply(self, response: Response) -> None:
        self.control.send(response)

    def _datapipes(self) -> List[DataPipe]:
        return [dp for _, dp in graph_datapipes(self.datapipe)]

    def _pause_response(self) -> PauseResponse:
        return PauseResponse(self.snapshot())  # the dispatcher's side of a consistent cut

    # --- handlers (control channel) ------------------------------------------------------------

    def _on_reset_epoch(self, request: ResetEpochRequest) -> None:
        self.iterator = None
        self.datapipe, _ = reset_graph(
            self.datapipe,
            self.worker_info,
            request.seed_generator,
            True,
            request.iter_reset_fn,
            self.custom_reset_fn,
        )
        self.epoch = request.epoch
        self.produced = 0
        for w in range(self.num_workers):
            self.credit[w] = self.sent[w] = 0
            self.pending[w].clear()
            self.end_sent[w] = False
        self.ended = None
        answer_child_checks(self._datapipes())
        self.iterator = iter(self.datapipe)
        self._reply(ResetEpochResponse(self.epoch))

    def _on_get_state(self, request: GetStateRequest) -> None:
        self._reply(GetStateResponse(self.snapshot(request.include_datapipe_states)))

    def snapshot(self, include_datapipe_states: bool = True) -> WorkerSnapshot:
        """The dispatcher's snapshot; a consistent cut with the workers when taken while paused."""
        graph = graph_datapipes(self.datapipe)
        return WorkerSnapshot(
            worker_id=DISPATCHER_ID,
            role="dispatcher",
            pid=os.getpid(),
            epoch=self.epoch,
            produced=self.produced,
            sent=sum(self.sent),
            buffered=sum(len(p) for p in self.pending),
            exhausted=self.ended is not None,
            paused=self.paused,
            datapipe_yields=datapipe_yields(graph),
            datapipe_states=datapipe_state_dicts(graph) if include_datapipe_states else {},
            sent_per_worker=tuple(self.sent),
        )


DispatcherLoop.HANDLERS = {
    **ServingLoop.HANDLERS,
    ResetEpochRequest: "_on_reset_epoch",
    GetStateRequest: "_on_get_state",
}


def run_dispatcher(
    datapipe: DataPipe,
    control: Endpoint,
    workers: Sequence[Endpoint],
    parent_pid: int,
    batching: BatchingOptions,
    custom_reset_fn: Optional[Callable[..., DataPipe]],
) -> None:
    """Entry point of the dispatching process."""
    torch.set_num_threads(1)
    ignore_job_signals()
    parent = ParentWatch(parent_pid)
    control.parent = parent
    for channel in workers:
        channel.parent = parent
    loop = DispatcherLoop(
        extract_wrapper(datapipe), control, workers, batching=batching, custom_reset_fn=custom_reset_fn
    )
    try:
        loop.run()
    finally:
        control.close()
        for channel in workers:
            channel.close()


class DispatchedSource(IterDataPipe):
    """In a worker, the items the dispatching process sends to it, in order.

    Counters for the current epoch: ``received`` items read from the pipe, ``consumed`` items
    handed to the graph; ``credit`` what it granted; ``received == consumed + len(buffer)``.
    """

    def __init__(self, channel: Channel, window: int = DISPATCH_WINDOW) -> None:
        self.channel = channel
        self.window = window
        self.epoch = NO_EPOCH
        self.buffer: Deque[Any] = deque()
        self.received = self.consumed = 0
        self.credit = Credit(window)

    def reset_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.buffer.clear()
        self.received = self.consumed = 0
        self.credit = Credit(self.window)

    def __iter__(self) -> Iterator[Any]:
        while True:
            if not self.buffer:
                self._top_up()
                self._read()
                continue
            item = self.buffer.popleft()
            if item is END:
                self.buffer.appendleft(END)  # stays ended until the next epoch
                return
            if isinstance(item, Raised):
                item.exc.reraise()
            self.consumed += 1
            self._top_up()
            yield item

    def _top_up(self) -> None:
        count = self.credit.top_up(self.consumed)
        if count:
            self.channel.send(GetNextRequest(self.epoch, count))

    def _read(self) -> None:
        response = self.channel.recv(timeout_s=None, what="a dispatched item")
        added = file_response(response, self.epoch, self.buffer)
        if added is not None:
            self.received += added
        elif isinstance(response, ErrorResponse):
            response.exc.reraise()
        else:
            raise ProtocolError(f"a worker received {type(response).__name__} from the dispatching process")

    def drain_until(self, sent: int) -> None:
        """Read what the (paused) dispatcher already sent, so that ``received == sent``."""
        while self.received < sent:
            self._read()

    # Never pickled for real: graph traversal only needs to know it has no parents.
    def __getstate__(self) -> Dict[str, Any]:
        return {"window": self.window}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.channel = None  # type: ignore[assignment]
        self.epoch, self.buffer = NO_EPOCH, deque()
        self.received = self.consumed = 0
        self.credit = Credit(self.window)


def find_dispatched_sources(
    datapipe: DataPipe, graph: Optional[DataPipeGraph] = None
) -> List[DispatchedSource]:
    """The graph's sources reading from a dispatching process (``graph``: ``datapipe``'s, if the
    caller traversed it already)."""
    return cast(
        List[DispatchedSource], find_dps(traverse(datapipe) if graph is None else graph, DispatchedSource)
    )
