"""``Outlet``: the last DataPipe of the adapted graph, where items reach the user.

Everything before the outlet runs ahead of the user (prefetching); the outlet counts what it
hands out, notes when ``StopIteration`` reached the user, and keeps the position in each
worker's stream that the user reached: when the main-process tail is one-to-one (no tail, or
``map``, ``collate``, ``fullsync``, ``prefetch``, ``pin_memory``, by exact class) the consumer and
the outlet share a :class:`~torchdata_snapshot.core.main.positions.UserPositions`: the outlet
takes one record of the consumer's for each item it hands to the user, so
``positions.delivered[i]`` is exactly how far the user got into worker ``i``'s stream, whatever
the tail buffers. A checkpoint describes that position (the checkpoint's outlet extends this one
to replay the positions it cannot tell, see the checkpointing docs).

With ``num_workers=0`` the outlet produces an item when the user asks for it, as torchdata does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, List, Optional

from torch.utils.data import IterDataPipe
from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._compat.datapipes import unhooked_iter
from torchdata_snapshot._constants import NO_EPOCH
from torchdata_snapshot._errors import ReadingServiceClosedError
from torchdata_snapshot.core.main.positions import UserPositions

__all__ = ["Outlet", "OutletIterator"]


class Outlet(IterDataPipe):
    """Counting pass-through at the end of the graph (see the module docstring).

    Attributes (current epoch): ``delivered`` items handed to the user; ``finished`` once
    ``StopIteration`` reached the user; ``positions`` the user's position in the workers' streams
    (when it is tracked; ``None`` when the tail batches or filters, or without workers);
    ``closed`` once the reading service was shut down.
    """

    def __init__(self, source_datapipe: DataPipe, positions: Optional[UserPositions] = None) -> None:
        self.source_datapipe = source_datapipe
        self.positions = positions
        self.epoch = NO_EPOCH
        self.delivered = 0
        self.finished = False
        self.closed = False  # the reading service was shut down: no item comes out any more

    def start_epoch(
        self,
        epoch: int,
        *,
        delivered: int = 0,
        worker_delivered: Optional[List[int]] = None,
        last_worker: int = -1,
    ) -> None:
        """Reset the counters for ``epoch``; a restore resumes them (``delivered`` in all, and with
        tracked positions ``worker_delivered`` per worker and the ``last_worker`` delivered from)."""
        self.epoch = epoch
        self.finished = False
        if self.positions is not None:
            self.positions.start_epoch(worker_delivered, last_worker)
        self.delivered = delivered

    if TYPE_CHECKING:  # (at run time, ``_iter`` below, set out of torch's hook)

        def __iter__(self) -> Iterator[Any]:
            """``_iter`` (for type checkers only)."""

    def _iter(self) -> Iterator[Any]:
        """``__iter__`` (set below, out of torch's hook: the iterator checks its epoch itself)."""
        return OutletIterator(self, iter(self.source_datapipe), self.epoch)

    @property
    def _number_of_samples_yielded(self) -> int:  # what torch's hook would have counted
        return self.delivered

    @_number_of_samples_yielded.setter
    def _number_of_samples_yielded(self, value: int) -> None:
        pass  # (torch resets it with the DataPipe; the outlet resets ``delivered`` per epoch)

    @property
    def produced_ahead(self) -> int:
        """Items produced ahead of the user and not handed out yet (in this process)."""
        return 0

    def __len__(self) -> int:
        return len(self.source_datapipe)


unhooked_iter(Outlet, Outlet._iter)


class OutletIterator:
    """The iterator of one epoch of an :class:`Outlet`: ``StopIteration`` once another epoch
    started, ``ReadingServiceClosedError`` once the reading service was shut down."""

    __slots__ = ("outlet", "source", "epoch")

    def __init__(self, outlet: Outlet, source: Iterator[Any], epoch: int) -> None:
        self.outlet = outlet
        self.source: Optional[Iterator[Any]] = source
        self.epoch = epoch

    def __iter__(self) -> OutletIterator:
        return self

    def __next__(self) -> Any:
        outlet = self.outlet
        if outlet.closed or outlet.epoch != self.epoch:
            self._check(outlet)
        try:
            item = self._produce(outlet)
        except StopIteration:
            outlet.finished = True
            raise
        return self._deliver(outlet, item)

    def _check(self, outlet: Outlet) -> None:
        """Raise if this iterator may give no more items: the service closed, or its epoch over."""
        if outlet.closed:  # also in this process (num_workers=0), where the graph could go on
            raise ReadingServiceClosedError(
                "the reading service was shut down (DataLoader2.shutdown() or finalize()): its "
                "iterators yield nothing more; create a new DataLoader2 to iterate again"
            )
        if outlet.epoch != self.epoch:
            raise StopIteration  # an iterator of an epoch that is over

    def _produce(self, outlet: Outlet) -> Any:
        if self.source is None:
            raise StopIteration
        try:
            return next(self.source)
        except StopIteration:
            self.source = None
            raise

    def _deliver(self, outlet: Outlet, item: Any) -> Any:
        outlet.delivered += 1
        if outlet.positions is not None:
            outlet.positions.deliver_one()
        return item
