"""``CapturePacer``: when a worker captures the state of its graph, for stateful restore.

A capture costs time (a large shuffle buffer takes a while to copy and pickle) and a restore
replays what came after the latest capture before the user's position. The pacer aims at
``CAPTURE_TIME_BUDGET`` (1%) of the worker's production time for captures, so that the items
between two captures take at most 100 times a capture's cost to produce, or one item when an
item costs more: that bounds the replay of a restore *in time*, at every position, whatever an
item costs. The count of items is rounded down (the bound is the promise, the budget a target:
captures take less than 2% when items are slow). The first capture follows the first item (its
cost is unknown before) and a second one the next item: the first pays for one-time work (cold
caches and code paths, numpy's layout check) and cost two to four times a later one,
so that a restore early in an epoch replayed 25 ms of 1 ms items. The second one's cost paces
the rest, at most ``max_items_between_captures`` items apart. A restore's replay starts the same way.

A graph with a cheap state is captured often (restores replay little), one holding a large
buffer less often (it costs little while streaming). Time spent waiting for credit does not
count as production: a worker ahead of a slow training step would otherwise capture after every
item, and every message would carry a state. A capture's cost is the CPU time of the capturing
thread: waiting for the GIL (held by the outbox thread as it writes) is not part of it, and
counting it made captures ten times rarer on a busy machine.
"""

from __future__ import annotations

from typing import Callable, Tuple

from torchdata_snapshot._constants import CAPTURE_TIME_BUDGET

__all__ = ["CapturePacer"]


class CapturePacer:
    """Paces one worker's captures; ``clock`` is ``time.perf_counter`` (tests pass their own)."""

    def __init__(self, max_items_between_captures: int, clock: Callable[[], float]) -> None:
        self.max_items_between_captures = max_items_between_captures
        self.clock = clock
        self.start_epoch()

    def start_epoch(self) -> None:
        self.next_capture = 1  # the produced count at which to capture next
        self._paced = False  # whether a capture of this stretch has been measured without its first
        self._busy_s = 0.0  # production time this epoch, waits for credit excluded
        self._producing_since = 0.0
        self._last: Tuple[float, int] = (0.0, 0)  # (busy seconds, produced) at the last capture

    def start_producing(self) -> None:
        self._producing_since = self.clock()

    def stop_producing(self) -> None:
        self._busy_s += self.clock() - self._producing_since

    def due(self, produced: int) -> bool:
        return produced >= self.next_capture

    def captured(self, produced: int, capture_s: float) -> None:
        """A capture that took ``capture_s`` (CPU time) was taken after item ``produced``:
        schedule the next."""
        busy_s = self._busy_s + (self.clock() - self._producing_since)
        if not self._paced:  # the first: its cost includes one-time work, measure the next one
            self._paced = True
            self.next_capture, self._last = produced + 1, (busy_s, produced)
            return
        # (The capture ran within this stretch of production: it is not the items' cost.)
        per_item_s = max(0.0, busy_s - self._last[0] - capture_s) / max(1, produced - self._last[1])
        wanted = capture_s / (CAPTURE_TIME_BUDGET * max(per_item_s, 1e-9))
        # Rounded down (1e-6: not below a whole count that float arithmetic missed by a hair).
        self.next_capture = produced + max(1, min(self.max_items_between_captures, int(wanted + 1e-6)))
        self._last = (busy_s, produced)

    def replayed(self, produced: int) -> None:
        """A restore replayed up to item ``produced``: replayed items do not pace captures, and
        the next two captures start the pacing afresh."""
        self._last = (self._busy_s, produced)
        self._paced = False
