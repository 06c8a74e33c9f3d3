"""``WorkerRecord``: one worker's stream of items, as the main process keeps it in one epoch.

The consumer (:mod:`torchdata_snapshot.core.main.consumer`) holds one per worker: its channel, the items
received and not handed on yet, the credit granted, and, when a checkpoint keeps one, the
stream's log (a :class:`~torchdata_snapshot.core.plugins.StreamLog`: what a fresh worker needs to
be brought back to a position of this stream). See NOTE [ Snapshot protocol ] in
:mod:`torchdata_snapshot.core.messages` for the words.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Optional

from torchdata_snapshot.core.messages import ItemsResponse, Response
from torchdata_snapshot.core.plugins import StreamLog
from torchdata_snapshot.core.transport.batches import END, Credit, Raised, file_response, small_items_window
from torchdata_snapshot.core.transport.channel import Channel

__all__ = ["WorkerRecord"]


class WorkerRecord:
    """Worker ``worker_id``'s stream in the current epoch.

    Counters (checked by :meth:`counts_add_up`): ``received`` items read from the pipe,
    ``handed_on`` items given to the next DataPipe, ``credit.granted`` items the worker may send;
    always ``received == handed_on + items in buffer`` and
    ``handed_on <= received <= credit.granted``.

    ``log`` (checkpoints and self-healing) keeps what bringing a fresh worker to a position of
    the stream needs; :meth:`prune` tells it which positions may still be asked for.
    """

    def __init__(
        self,
        worker_id: int,
        channel: Channel,
        window: int,
        small_items_bytes: int = 0,
        log: Optional[StreamLog] = None,
    ) -> None:
        self.worker_id = worker_id
        self.channel = channel
        self.window = window
        self.small_items_bytes = small_items_bytes  # see small_items_window (0: the window only)
        self._item_bytes = 0  # the largest average pickled size of the items of a message
        self._shared = False  # some items held shared memory
        self.buffer: Deque[Any] = deque()  # items, then END or Raised where the stream stopped
        self.received = 0
        self.handed_on = 0
        self.credit = Credit(window)
        self.exhausted = True  # nothing to read before the first epoch
        self.restarts = 0  # replacements of the worker this epoch
        self.log = log

    def start(self, delivered: int = 0, position: Any = None) -> None:
        """Start the epoch after its first ``delivered`` items (``0``: the beginning); ``position``
        is the log's record of that point (``None``: the epoch's beginning)."""
        self.buffer.clear()
        self.received = self.handed_on = delivered
        self.credit = Credit(self.window, granted=delivered)  # grown by the epoch's first small items
        self._item_bytes, self._shared = 0, False
        self.exhausted = False
        if self.log is not None:
            self.log.start(position)

    # --- data ---------------------------------------------------------------------------------

    def file(self, response: Response, epoch: int) -> bool:
        """Keep a data or state response of this stream; ``False`` if it is neither (a control
        answer, which the caller handles)."""
        first = self.received + 1
        pool = None if self.channel is None else self.channel.pool  # (no channel: in-process tests)
        try:
            added = file_response(response, epoch, self.buffer, pool)
        except (OSError, EOFError) as e:
            # Unpickling a tensor asks the sender's resource sharer for its shared memory: if the
            # sender died, that is its death (none of the message's items counts as received).
            if self.channel is not None:
                self.channel.raise_if_dead(e)
            raise
        if added is not None:
            if added:
                assert isinstance(response, ItemsResponse)
                if self.log is not None:
                    self.log.filed(first, response)
                self.received += added
                self._item_bytes = max(self._item_bytes, len(response.payload) // added)
                self._shared = self._shared or response.shared > 0
                self.credit.window = small_items_window(
                    self.window, self._item_bytes, self._shared, self.small_items_bytes
                )
            return True
        return self.log is not None and self.log.file(response, epoch)

    def take(self) -> Any:
        """The next entry of the buffer: an item (counted as handed on), ``END`` or ``Raised``."""
        entry = self.buffer.popleft()
        if entry is END or isinstance(entry, Raised):
            self.exhausted = True
        else:
            self.handed_on += 1
        return entry

    def grant(self) -> int:
        """How much more credit to send now (``0``: none yet)."""
        return self.credit.top_up(self.handed_on)

    def counts_add_up(self) -> bool:
        items = sum(1 for entry in self.buffer if entry is not END and not isinstance(entry, Raised))
        return (
            self.received == self.handed_on + items and self.handed_on <= self.received <= self.credit.granted
        )

    def prune(self, kept: int) -> None:
        """Positions before ``kept`` will not be asked for any more: the log may drop what only
        they need."""
        if self.log is not None:
            self.log.prune(kept)
