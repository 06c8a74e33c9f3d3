"""Drives a worker loop in-process: requests go in a pipe, the loop runs until it is idle after
each, responses come out; for the tests of the worker loops."""

from typing import Any, List, Optional, Type

from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterDataPipe

from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.options import BatchingOptions, RestoreOptions, WorkerOptions
from torchdata_snapshot.core.transport.channel import make_pipe_pair
from torchdata_snapshot.core.transport.item_codec import ItemDecoder
from torchdata_snapshot.core.worker.loop import WorkerLoop


def serve(
    datapipe: Any,
    requests: List[Any],
    batching: BatchingOptions = BatchingOptions(),
    init_error: Optional[Any] = None,
    verify_replay: bool = True,
    max_items_between_captures: int = 1024,
    loop: Type[WorkerLoop] = WorkerLoop,
) -> List[Any]:
    """Send ``requests`` one by one (then a terminate) to a ``loop`` serving ``datapipe``, letting
    it finish the work of each before the next; return the responses (read after each request: a
    pipe is bounded)."""
    channel, endpoint, _ = make_pipe_pair()
    restore = RestoreOptions(
        verify_replay=verify_replay, max_items_between_captures=max_items_between_captures
    )
    options = WorkerOptions(batching=batching, restore=restore)
    served = loop(datapipe, endpoint, WorkerInfo(1, 0), options=options, init_error=init_error)
    responses = []
    for request in [*requests, m.TerminateRequest()]:
        channel.send(request)
        served.run_until_idle()
        while channel.poll():
            responses.append(channel.recv(timeout_s=1))
    assert served.terminated
    assert isinstance(responses[-1], m.TerminateResponse)
    return responses[:-1]


def reset(epoch: int = 0, seed: int = 0) -> m.ResetEpochRequest:
    return m.ResetEpochRequest(SeedGenerator(seed), None, epoch=epoch)


def items_of(responses: List[Any]) -> List[Any]:
    out: List[Any] = []
    for r in responses:
        if isinstance(r, m.ItemsResponse):
            out.extend(ItemDecoder.decode(r.count, r.payload))
    return out


class Counting(IterDataPipe):
    """Counts how many items it was asked for: production must follow credit."""

    def __init__(self, source: IterDataPipe) -> None:
        self.source = source
        self.pulled = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for x in self.source:
            self.pulled += 1
            yield x
