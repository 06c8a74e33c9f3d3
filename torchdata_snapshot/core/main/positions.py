"""``UserPositions``: how far the user got into each worker's stream.

A checkpoint describes what the *user* received, while everything before the outlet runs ahead.
When the DataPipes between the consumer and the outlet hand on exactly one item per item they
take, in order (no tail, or ``map``, ``collate``, ``fullsync``, ``prefetch``, ``pin_memory``:
:data:`ONE_TO_ONE_TAIL`, see :func:`not_one_to_one`), the position is known exactly:
the consumer records which worker each item it hands on came from, and the outlet takes one
record for every item it delivers. Both are given the same ``UserPositions`` by the reading
service; see NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages`.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional, Sequence, Tuple

from torchdata.dataloader2.graph import DataPipe, list_dps

from torchdata_snapshot.core.catalogue import types_where
from torchdata_snapshot.core.traversal import traverse

__all__ = ["ONE_TO_ONE_TAIL", "UserPositions", "not_one_to_one"]

#: Main-process DataPipes that hand on exactly one item per item they take, in order, by exact
#: type: a subclass may not (a ``map`` subclass may keep items back). Through a tail made only of
#: these, the user's position maps onto the workers' streams (``main_tail`` in the catalogue).
ONE_TO_ONE_TAIL: Tuple[type, ...] = types_where(main_tail=True)


def not_one_to_one(end: DataPipe, replicable: DataPipe) -> List[DataPipe]:
    """The DataPipes of ``end``'s graph that stay in the main process (all but the replicable
    branch) and are not known to hand on one item per item they take, output first."""
    in_workers = {id(dp) for dp in list_dps(traverse(replicable))}
    tail = [dp for dp in list_dps(traverse(end)) if id(dp) not in in_workers]
    return [dp for dp in tail if type(dp) not in ONE_TO_ONE_TAIL]


class UserPositions:
    """Per worker, the items of its stream that reached the user this epoch (``delivered``), and
    the worker the last delivered item came from (``last_worker``, ``-1`` before the first)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.delivered: List[int] = [0] * num_workers
        self.last_worker = -1
        self._in_flight: Deque[int] = deque()  # workers of the items handed on, not delivered yet

    def handed_on(self, worker_id: int) -> None:
        """The consumer handed on an item of worker ``worker_id``."""
        self._in_flight.append(worker_id)

    def deliver_one(self) -> None:
        """The outlet delivered the oldest item handed on."""
        worker_id = self._in_flight.popleft()
        self.delivered[worker_id] += 1
        self.last_worker = worker_id

    def start_epoch(self, delivered: Optional[Sequence[int]] = None, last_worker: int = -1) -> None:
        """A new epoch, or a restored position in one."""
        self._in_flight.clear()
        self.delivered = list(delivered) if delivered else [0] * self.num_workers
        self.last_worker = last_worker

    @property
    def next_worker(self) -> int:
        """The worker the round-robin asks next, as the user sees it."""
        return (self.last_worker + 1) % self.num_workers if self.last_worker >= 0 else 0
