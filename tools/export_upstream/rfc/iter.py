"""GetStateRequest answered by the loops of worker and dispatching processes, between two items.

A loop serves one request at a time, so while it answers its graph is not running; the reading
service pauses every process first (``MultiProcessingReadingService.snapshot()``), so that the
states of all processes form one consistent cut. A DataPipe that cannot give a count or a state
(a map-style DataPipe keeps no count; a ``state_dict()`` may raise or return what cannot be sent)
is left out of the snapshot: the worker goes on. While the main process waits for the answers
of a pause or a snapshot, it checks that the processes that would answer are alive.
"""

import functools
import os
import time
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Dict, List, Optional, Tuple

from torch.utils.data import IterDataPipe

from torchdata._constants import default_timeout_in_s
from torchdata.dataloader2 import communication
from torchdata.dataloader2.graph import DataPipe, find_dps, list_dps, traverse_dps
from torchdata.dataloader2.worker_snapshot import WorkerSnapshot

TARGET = "torchdata/dataloader2/communication/iter.py"

#: The request loops that answer GetStateRequest: (function, request, the statement answering it).
BRANCHES = (
    (
        "DataPipeBehindQueues",
        "GetStateRequest",
        "yield from _answer_get_state(source_datapipe, protocol, loop_id, worker_info, request_counter)",
    ),
)


def _started(source_datapipe: IterDataPipe) -> bool:
    """Whether the loop's iterator of this epoch exists (a reset drops it; the first item makes it)."""
    return getattr(source_datapipe, "_as_iterator", None) is not None


def _yielded(datapipe: DataPipe) -> Optional[int]:
    """The items ``datapipe`` yielded this epoch, or ``None`` if it keeps no count (a MapDataPipe)."""
    count = getattr(datapipe, "_number_of_samples_yielded", None)
    return count if isinstance(count, int) else None


def _sendable_state(datapipe: DataPipe) -> Tuple[bool, object]:
    """``(True, datapipe.state_dict())`` if it has one that crosses the process boundary, else ``(False, None)``."""
    state_dict = getattr(datapipe, "state_dict", None)
    if not callable(state_dict):
        return False, None
    try:
        state = state_dict()
        ForkingPickler.dumps(state)  # as the response queue will pickle it
    except Exception:
        return False, None
    return True, state


def _datapipe_counts(source_datapipe: IterDataPipe) -> Tuple[Dict[str, int], Dict[str, object]]:
    """Per DataPipe of the loop's graph (keyed ``index:type``, breadth-first from the output): the
    items it yielded this epoch, and ``state_dict()`` of those that have one; a DataPipe that
    keeps no count, or whose state cannot be given, is absent from the dict concerned."""
    started = _started(source_datapipe)
    yields: Dict[str, int] = {}
    states: Dict[str, object] = {}
    for index, datapipe in enumerate(list_dps(traverse_dps(source_datapipe))):
        key = f"{index}:{type(datapipe).__name__}"
        count = _yielded(datapipe)
        if count is not None:
            yields[key] = count if started else 0
        has_state, state = _sendable_state(datapipe)
        if has_state:
            states[key] = state
    return yields, states


def _answer_get_state(source_datapipe, protocol, loop_id, worker_info, request_counter):
    """Answer a GetStateRequest with this loop's :class:`WorkerSnapshot`.

    A worker fed by a dispatching process first asks the dispatching process's loop that serves
    it, and sends that loop's snapshot with its own. A loop of the dispatching process
    (``request_counter`` is set for those) reports the items it sent to its worker.
    """
    dispatchers = find_dps(traverse_dps(source_datapipe), _IterateQueueDataPipes)
    dispatcher = tuple(response.snapshot for dp in dispatchers for response in dp.request_get_state())
    sent = (_yielded(source_datapipe) or 0) if _started(source_datapipe) else 0
    yields, states = _datapipe_counts(source_datapipe)
    if request_counter is None:
        snapshot = WorkerSnapshot(
            worker_id=worker_info.worker_id,
            role="worker",
            pid=os.getpid(),
            epoch=-1,  # the main process knows the epoch and fills it in
            produced=sent,
            sent=sent,
            buffered=0,
            batches=sent,  # one item a message
            paused=protocol.is_paused(),
            datapipe_yields=yields,
            datapipe_states=states,
            received_from_dispatcher=sum(d.sent for d in dispatcher),
        )
    else:
        per_worker = tuple(sent if i == loop_id else 0 for i in range(worker_info.num_workers))
        snapshot = WorkerSnapshot(
            worker_id=-1,
            role="dispatcher",
            pid=os.getpid(),
            epoch=-1,
            produced=sent,
            sent=sent,
            buffered=0,
            batches=sent,
            paused=protocol.is_paused(),
            datapipe_yields=yields,
            datapipe_states=states,
            sent_per_worker=per_worker,
        )
    protocol.response_get_state(snapshot, dispatcher)
    yield True  # Returns control


def _await_response(get: Callable[[], object], check_alive: Optional[Callable[[], None]], what: str) -> object:
    """``get()``'s response, polled as upstream's waits poll; between polls ``check_alive()`` raises
    if a process that would answer is gone, and the wait ends after ``default_timeout_in_s``."""
    deadline = time.monotonic() + default_timeout_in_s
    while True:
        try:
            return get()
        except communication.protocol.EmptyQueue:
            if check_alive is not None:
                check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"No answer to {what} within {default_timeout_in_s} seconds") from None
            if NonBlocking.not_available_hook is not None:
                NonBlocking.not_available_hook()


class QueueWrapper:
    def request_get_state(self) -> None:
        self.protocol.request_get_state()

    def get_state_response(self, check_alive: Optional[Callable[[], None]] = None):
        return _await_response(self.protocol.get_response_get_state, check_alive, "GetStateRequest")


class _IterateQueueDataPipes:
    #: Raises if a process that answers this consumer's requests has exited (the reading service
    #: sets it); ``None``: not checked.
    check_alive: Optional[Callable[[], None]] = None

    def _keep_responses_in_flight(self) -> None:
        """Store the answers to the requests in flight for the iteration: a process answers one
        request at a time."""
        for idx, dp in enumerate(self.datapipes):
            if dp.protocol.waiting_for_response():
                response = _await_response(dp.protocol.get_response_next, self.check_alive, "GetNextRequest")
                self.res_buffers[idx].append(response)

    def request_pause(self, pause_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        self._keep_responses_in_flight()
        for dp in self.datapipes:
            dp.request_pause(pause_fn)
        for dp in self.datapipes:
            _await_response(dp.protocol.get_response_pause, self.check_alive, "PauseRequest")

    def request_resume(self, resume_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        for dp in self.datapipes:
            dp.request_resume(resume_fn)
        for dp in self.datapipes:
            _await_response(dp.protocol.get_response_resume, self.check_alive, "ResumeRequest")
        self._request_cnt = 0

    def request_terminate(self) -> None:
        """Drop the answers in flight, then ask every process to end. A process that has exited
        never answers: its request is dropped with the others when it is asked to end."""
        self._terminated = True
        for dp in self.datapipes:
            discard = functools.partial(dp.protocol.discard_existing_request, block=False)
            try:
                _await_response(discard, self.check_alive, "the request in flight")
            except RuntimeError:
                pass
        for dp in self.datapipes:
            dp.protocol.request_terminate()

    def request_get_state(self) -> List:
        """Each process's GetStateResponse, in order. Answers to requests in flight are kept for
        the iteration (as a pause keeps them), since a process answers one request at a time."""
        self._keep_responses_in_flight()
        for dp in self.datapipes:
            dp.request_get_state()
        return [dp.get_state_response(self.check_alive) for dp in self.datapipes]
