"""``WorkerRecord``: one worker's stream of items, as the main process keeps it in one epoch.

The consumer (:mod:`torchdata_snapshot.core.main.consumer`) holds one per worker: its channel, the items
received and not handed on yet, the credit granted, and what checkpoints and self-healing need
to bring a fresh worker back to a position of this stream (its running digests and captured
graph states). See NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages` for the
words.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Any, Deque, Optional, Tuple

from torchdata_snapshot.checkpoint.digest import chain_hex, parse_chain_hex
from torchdata_snapshot.checkpoint.format import CapturedState, WorkerPosition
from torchdata_snapshot.core.messages import ItemsResponse, ReplayRequest, Response, StateMarkResponse
from torchdata_snapshot.core.transport.batches import END, Credit, Raised, file_response, small_items_window
from torchdata_snapshot.core.transport.channel import Channel

__all__ = ["WorkerRecord"]


class ItemLog:
    """A number per received item (``array`` type ``typecode``), kept as the messages brought
    them: ``(position of the first item, packed numbers)``; :meth:`at` reads one back."""

    def __init__(self, typecode: str) -> None:
        self.typecode = typecode
        self.size = array(typecode).itemsize
        self.entries: Deque[Tuple[int, bytes]] = deque()

    def clear(self, position: int = 0, value: Optional[int] = None) -> None:
        """Forget everything; ``value``, if given, is the number known at ``position``."""
        self.entries.clear()
        if value is not None:
            self.entries.append((position, array(self.typecode, [value]).tobytes()))

    def append(self, first: int, packed: Optional[bytes]) -> None:
        if packed is not None:
            self.entries.append((first, packed))

    def at(self, position: int) -> Optional[int]:
        """The number of the ``position``-th item, if kept."""
        for first, packed in self.entries:
            index = position - first
            if 0 <= index < len(packed) // self.size:
                return array(self.typecode, packed[index * self.size : (index + 1) * self.size])[0]
        return None

    def prune(self, kept: int) -> None:
        """Drop the messages wholly before position ``kept`` (but the last one)."""
        entries = self.entries
        while len(entries) > 1 and entries[0][0] + len(entries[0][1]) // self.size <= kept:
            entries.popleft()


class WorkerRecord:
    """Worker ``worker_id``'s stream in the current epoch.

    Counters (checked by :meth:`counts_add_up`): ``received`` items read from the pipe,
    ``handed_on`` items given to the next DataPipe, ``credit.granted`` items the worker may send;
    always ``received == handed_on + items in buffer`` and
    ``handed_on <= received <= credit.granted``.

    For checkpoints and self-healing it keeps the running digests of the received items from
    the batch holding the *kept* position on, and the graph states from the latest one strictly
    behind it on; :meth:`prune` drops the rest as the kept position moves forward.
    """

    def __init__(self, worker_id: int, channel: Channel, window: int, small_items_bytes: int = 0) -> None:
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
        self._digests = ItemLog("Q")  # running digests
        self._taken = ItemLog("q")  # sharding positions (what an elastic restore deals from)
        self._partial = ItemLog("q")  # and inside the last element (see _element_progress)
        self._states: Deque[CapturedState] = deque()
        # (position, packed FileOrigins): the files the items from the kept state on opened.
        self._opened: Deque[Tuple[int, bytes]] = deque()

    def start(self, position: WorkerPosition) -> None:
        """Start the epoch at ``position`` (the beginning, or a restored position)."""
        done = position.delivered
        self.buffer.clear()
        self.received = self.handed_on = done
        self.credit = Credit(self.window, granted=done)  # grown by the epoch's first small items
        self._item_bytes, self._shared = 0, False
        self.exhausted = False
        # Known at the restored position, as if received:
        self._digests.clear(done, None if position.digest is None else parse_chain_hex(position.digest))
        self._taken.clear(done, position.taken if done else 0)
        self._partial.clear(done, position.partial if done else None)
        self._states.clear()
        self._opened.clear()
        if position.state is not None:
            self._states.append(position.state)
        after_state = 1 if position.state is None else position.state[0] + 1
        self._opened.extend((after_state, blob) for blob in position.opened)

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
                self._digests.append(first, response.digests)
                self._taken.append(first, response.taken)
                self._partial.append(first, response.partial)
                self._opened.extend((first + index, blob) for index, blob in response.opened)
                self.received += added
                self._item_bytes = max(self._item_bytes, len(response.payload) // added)
                self._shared = self._shared or response.shared > 0
                self.credit.window = small_items_window(
                    self.window, self._item_bytes, self._shared, self.small_items_bytes
                )
            return True
        if isinstance(response, StateMarkResponse):
            if response.epoch == epoch:
                self._states.append((response.position, response.state, self.digest_at(response.position)))
            return True
        return False

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

    # --- positions ----------------------------------------------------------------------------

    def digest_at(self, position: int) -> Optional[str]:
        """The running digest after the ``position``-th item of the stream, if kept."""
        digest = self._digests.at(position)
        return None if digest is None else chain_hex(digest)

    def state_before(self, position: int) -> Optional[CapturedState]:
        """The latest graph state captured strictly before ``position``: a restore from it
        replays, and checks, at least the item at ``position``."""
        behind = [state for state in self._states if state[0] < position]
        return behind[-1] if behind else None

    def position(self, at: int) -> WorkerPosition:
        """What a fresh worker needs to be brought to item ``at`` of this stream: the files that
        replaying from the state opens again are among it, to be checked first."""
        state = self.state_before(at)
        after = 0 if state is None else state[0]
        opened = tuple(blob for position, blob in self._opened if after < position <= at)
        return WorkerPosition(at, self.digest_at(at), state, self._taken.at(at), self._partial.at(at), opened)

    def prune(self, kept: int) -> None:
        """Positions before ``kept`` will not be asked for any more: drop what only they need."""
        self._digests.prune(kept)
        self._taken.prune(kept)
        self._partial.prune(kept)
        while len(self._states) > 1 and self._states[1][0] < kept:
            self._states.popleft()
        if self._states and self._states[0][0] < kept:  # the state a position >= kept starts from
            while self._opened and self._opened[0][0] <= self._states[0][0]:
                self._opened.popleft()

    @property
    def kept_entries(self) -> int:
        """How many batches of digests and graph states are kept (memory does not grow with k)."""
        logs = (self._digests, self._taken, self._partial)
        return sum(len(log.entries) for log in logs) + len(self._states) + len(self._opened)


def replay_request(epoch: int, position: WorkerPosition) -> ReplayRequest:
    """Bring a freshly reset worker to ``position``: from its recorded graph state when there is
    one (stateful restore), else from the epoch's start; the running digest of the replayed
    items is checked against the recorded one."""
    if position.state is None:
        return ReplayRequest(epoch, position.delivered, position.digest, opened=position.opened)
    start, blob, state_digest = position.state
    return ReplayRequest(
        epoch, position.delivered - start, position.digest, (start, blob), state_digest, position.opened
    )
