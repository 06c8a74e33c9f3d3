"""The snapshot RFC's request and response, beside the other messages of the queue protocol."""

from typing import Optional, Tuple

from torchdata.dataloader2.worker_snapshot import WorkerSnapshot

TARGET = "torchdata/dataloader2/communication/messages.py"


class GetStateRequest(Request):
    """Asks a loop for its state; sent while the graph is paused, so the states form one cut."""

    __slots__ = ()


class GetStateResponse(Response):
    """A loop's :class:`WorkerSnapshot`, and those of the dispatching process's loops it reads from."""

    __slots__ = ("snapshot", "dispatcher")

    def __init__(self, snapshot: WorkerSnapshot, dispatcher: Optional[Tuple[WorkerSnapshot, ...]] = None) -> None:
        self.snapshot = snapshot
        self.dispatcher = dispatcher or ()
