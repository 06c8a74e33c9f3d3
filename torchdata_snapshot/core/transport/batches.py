"""The two ends of a stream of items, as both links of the protocol use them.

A stream runs from a worker to the main process, and from the dispatching process to each
worker. On the sending side items are pickled as they are produced, queued (:class:`QueuedItem`)
and sent as ``ItemsResponse`` batches (:func:`take_batch`, :func:`items_message`); on the
receiving side :func:`file_response` puts a data response into the reader's buffer (items, the
end of the stream, or the exception it ended with) and :class:`Credit` says when to grant more.
See NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages`.
"""

from __future__ import annotations

from array import array
from typing import Any, Deque, List, Optional, cast

from torchdata._utils import ExceptionWrapper

from torchdata_snapshot._constants import SMALL_ITEMS_MAX_WINDOW
from torchdata_snapshot.core.messages import (
    ItemsResponse,
    Response,
    StopIterationResponse,
    WorkerExceptionResponse,
)
from torchdata_snapshot.core.transport.item_codec import ItemDecoder, ItemPool

__all__ = [
    "END",
    "Credit",
    "QueuedItem",
    "Raised",
    "file_response",
    "items_message",
    "small_items_window",
    "take_batch",
]

# --- sending --------------------------------------------------------------------------------


class QueuedItem:
    """An item pickled by its producer, waiting to be sent, with the stream's running digest
    after it (``None`` when digests are off), whether it shares memory with the reader, and the
    elements its graph's sharding filter had taken when it was yielded (``None``: not counted,
    see :class:`~torchdata_snapshot.graph_state.worker_loop.ElasticWorker`) and the items of the
    last of them handed on (``partial``; ``None``: the graph has no expander), and the files
    opened while it was produced (``opened``: a pickled tuple of ``FileOrigin``, ``None`` when none was)."""

    __slots__ = ("epoch", "payload", "digest", "shared", "taken", "partial", "slot", "opened")

    def __init__(
        self,
        epoch: int,
        payload: bytes,
        digest: Optional[int] = None,
        shared: bool = False,
        taken: Optional[int] = None,
        partial: Optional[int] = None,
        slot: Optional[int] = None,
        opened: Optional[bytes] = None,
    ) -> None:
        self.epoch, self.payload, self.digest, self.shared = epoch, payload, digest, shared
        self.taken, self.partial = taken, partial
        self.slot = slot  # the tensor pool slot its tensors were copied into (see ItemPool)
        self.opened = opened


def take_batch(queue: Deque[Any], max_items: int, max_bytes: int) -> List[QueuedItem]:
    """Pop the item at the head of ``queue`` and those right behind it of the same epoch: at most
    ``max_items``, closed once the batch holds ``max_bytes`` pickled bytes."""
    first = queue.popleft()
    batch, size = [first], len(first.payload)
    while (
        queue
        and len(batch) < max_items
        and size < max_bytes
        and isinstance(queue[0], QueuedItem)
        and queue[0].epoch == first.epoch
    ):
        entry = queue.popleft()
        batch.append(entry)
        size += len(entry.payload)
    return batch


def items_message(batch: List[QueuedItem]) -> ItemsResponse:
    """One message for a batch of items of one epoch, with their running digests and sharding
    positions if kept, and the files opened while they were produced."""
    first = batch[0]
    digests = taken = partial = None
    if first.digest is not None:
        digests = array("Q", [cast(int, entry.digest) for entry in batch]).tobytes()
    if first.taken is not None:
        taken = array("q", [cast(int, entry.taken) for entry in batch]).tobytes()
    if first.partial is not None:
        partial = array("q", [cast(int, entry.partial) for entry in batch]).tobytes()
    payload = b"".join(entry.payload for entry in batch)
    opened = tuple((i, entry.opened) for i, entry in enumerate(batch) if entry.opened is not None)
    shared = sum(entry.shared for entry in batch)
    return ItemsResponse(first.epoch, len(batch), payload, digests, shared, taken, partial, opened)


# --- receiving ------------------------------------------------------------------------------


class _EndOfStream:
    """Buffer entry: the stream ends here (``StopIterationResponse``)."""

    def __repr__(self) -> str:
        return "END"


END = _EndOfStream()


class Raised:
    """Buffer entry: the sender's graph raised here; re-raised when the reader reaches it."""

    __slots__ = ("exc",)

    def __init__(self, exc: ExceptionWrapper) -> None:
        self.exc = exc


def file_response(
    response: Response, epoch: int, buffer: Deque[Any], pool: Optional[ItemPool] = None
) -> Optional[int]:
    """Put a data response of stream epoch ``epoch`` into ``buffer``; ``pool`` is the sender's
    tensor pool, if it has one.

    Returns how many items it added (``0`` for the end of the stream, an exception, or a stale
    response of another epoch, which is dropped), or ``None`` when ``response`` is not a data
    response. Items are unpickled even when stale, so that what they hold (tensors in shared
    memory, pool slots) is released.
    """
    if isinstance(response, ItemsResponse):
        if pool is not None:
            pool.reclaim()  # slots kept for forked processes that have exited since
        items = ItemDecoder.decode(response.count, response.payload, pool if response.shared else None)
        if response.epoch != epoch:
            return 0
        buffer.extend(items)
        return response.count
    if isinstance(response, StopIterationResponse):
        if response.epoch == epoch:
            buffer.append(END)
        return 0
    if isinstance(response, WorkerExceptionResponse):
        if response.epoch in (None, epoch):  # None: the sender is going away, whatever the epoch
            buffer.append(Raised(response.exc))
        return 0
    return None


def small_items_window(window: int, item_bytes: int, shared: bool, budget_bytes: int) -> int:
    """The credit window for a stream whose items pickle to at most ``item_bytes`` each (the
    largest average of a message so far): ``window``, or more for small items that travel whole
    in their pickles, as many as ``budget_bytes`` of them (at most ``SMALL_ITEMS_MAX_WINDOW``).

    Tiny items are produced faster than a credit grant travels: with ``window`` items in flight
    the worker would wait for every grant, and the stream would run at the pace of the round
    trip. A stream that sent items holding shared memory (tensors) keeps ``window``: their pickle
    is a handle, not their size, and the prefetch counts bound that memory exactly."""
    if budget_bytes <= 0 or shared:
        return window
    return max(window, min(SMALL_ITEMS_MAX_WINDOW, budget_bytes // max(1, item_bytes)))


class Credit:
    """The credit a reader grants one sender: ``window`` items may be outstanding; more is
    granted once half of the window was consumed (``granted - consumed <= window / 2``)."""

    __slots__ = ("window", "granted")

    def __init__(self, window: int, granted: int = 0) -> None:
        self.window = window
        self.granted = granted

    def top_up(self, consumed: int) -> int:
        """How much more to grant now that ``consumed`` items were taken (``0``: nothing yet)."""
        outstanding = self.granted - consumed
        if outstanding * 2 > self.window:
            return 0
        count = self.window - outstanding
        self.granted += count
        return count
