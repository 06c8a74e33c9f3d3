"""GetStateRequest answered by the loops of worker and dispatching processes, between two items.

A loop serves one request at a time, so while it answers its graph is not running; the reading
service pauses every process first (``MultiProcessingReadingService.snapshot()``), so that the
states of all processes form one consistent cut.
"""

import os
from typing import Dict, List, Tuple

from torch.utils.data import IterDataPipe

from torchdata._constants import default_timeout_in_s
from torchdata.dataloader2 import communication
from torchdata.dataloader2.graph import find_dps, list_dps, traverse_dps
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


def _datapipe_counts(source_datapipe: IterDataPipe) -> Tuple[Dict[str, int], Dict[str, object]]:
    """Per DataPipe of the loop's graph (keyed ``index:type``, breadth-first from the output): the
    items it yielded this epoch, and ``state_dict()`` of those that have one."""
    started = _started(source_datapipe)
    yields: Dict[str, int] = {}
    states: Dict[str, object] = {}
    for index, datapipe in enumerate(list_dps(traverse_dps(source_datapipe))):
        key = f"{index}:{type(datapipe).__name__}"
        yields[key] = datapipe._number_of_samples_yielded if started else 0
        state_dict = getattr(datapipe, "state_dict", None)
        if callable(state_dict):
            states[key] = state_dict()
    return yields, states


def _answer_get_state(source_datapipe, protocol, loop_id, worker_info, request_counter):
    """Answer a GetStateRequest with this loop's :class:`WorkerSnapshot`.

    A worker fed by a dispatching process first asks the dispatching process's loop that serves
    it, and sends that loop's snapshot with its own. A loop of the dispatching process
    (``request_counter`` is set for those) reports the items it sent to its worker.
    """
    dispatchers = find_dps(traverse_dps(source_datapipe), _IterateQueueDataPipes)
    dispatcher = tuple(response.snapshot for dp in dispatchers for response in dp.request_get_state())
    sent = source_datapipe._number_of_samples_yielded if _started(source_datapipe) else 0
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


class QueueWrapper:
    def request_get_state(self) -> None:
        self.protocol.request_get_state()

    def get_state_response(self):
        try:
            return self.protocol.get_response_get_state(block=True, timeout=default_timeout_in_s)
        except communication.protocol.EmptyQueue:
            raise TimeoutError(f"No answer to GetStateRequest within {default_timeout_in_s} seconds") from None


class _IterateQueueDataPipes:
    def request_get_state(self) -> List:
        """Each process's GetStateResponse, in order. Answers to requests in flight are kept for
        the iteration (as a pause keeps them), since a process answers one request at a time."""
        for idx, dp in enumerate(self.datapipes):
            if dp.protocol.waiting_for_response():
                self.res_buffers[idx].append(dp.protocol.get_response_next(block=True))
        for dp in self.datapipes:
            dp.request_get_state()
        return [dp.get_state_response() for dp in self.datapipes]
