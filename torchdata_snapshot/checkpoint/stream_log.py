"""``StreamLog``: what a checkpoint keeps of one worker's stream in the main process.

The consumer's :class:`~torchdata_snapshot.core.main.worker_record.WorkerRecord` counts a stream's
items; its log keeps, per item received, what a fresh worker needs to be brought back to that
position: the stream's running digest (:mod:`torchdata_snapshot.checkpoint.digest`), the elements
the sharding filter had taken and how far into the last one (elastic resume), the graph states
captured behind items (stateful restore) and the files read since. It keeps them from the batch
holding the *kept* position on, the states from the latest one strictly behind it on:
:meth:`StreamLog.prune` drops the rest as the position moves forward.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Deque, Optional, Tuple

from torchdata_snapshot.checkpoint.digest import chain_hex, parse_chain_hex
from torchdata_snapshot.checkpoint.format import CapturedState, WorkerPosition
from torchdata_snapshot.core.messages import ItemsResponse, ReplayRequest, Response, StateMarkResponse

__all__ = ["ItemLog", "StreamLog", "replay_request"]


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


class StreamLog:
    """One worker's stream, as a checkpoint needs it (see the module's docstring); a
    :class:`~torchdata_snapshot.core.plugins.StreamLog` of the core's record."""

    def __init__(self) -> None:
        self._digests = ItemLog("Q")  # running digests
        self._taken = ItemLog("q")  # sharding positions (what an elastic restore deals from)
        self._partial = ItemLog("q")  # and inside the last element (see elastic.element_progress)
        self._states: Deque[CapturedState] = deque()
        # (position, packed FileOrigins): the files the items from the kept state on opened.
        self._opened: Deque[Tuple[int, bytes]] = deque()

    def start(self, position: Optional[WorkerPosition]) -> None:
        """The epoch starts at ``position`` (``None``: its beginning), known as if received."""
        position = position or WorkerPosition()
        done = position.delivered
        self._digests.clear(done, None if position.digest is None else parse_chain_hex(position.digest))
        self._taken.clear(done, position.taken if done else 0)
        self._partial.clear(done, position.partial if done else None)
        self._states.clear()
        self._opened.clear()
        if position.state is not None:
            self._states.append(position.state)
        after_state = 1 if position.state is None else position.state[0] + 1
        self._opened.extend((after_state, blob) for blob in position.opened)

    def filed(self, first: int, response: ItemsResponse) -> None:
        """The items of ``response`` were received, the first of them at position ``first``."""
        self._digests.append(first, response.digests)
        self._taken.append(first, response.taken)
        self._partial.append(first, response.partial)
        self._opened.extend((first + index, blob) for index, blob in response.opened)

    def file(self, response: Response, epoch: int) -> bool:
        """Keep ``response`` if it is the log's (a graph state of ``epoch``, sent behind its item)."""
        if not isinstance(response, StateMarkResponse):
            return False
        if response.epoch == epoch:
            self._states.append((response.position, response.state, self.digest_at(response.position)))
        return True

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
