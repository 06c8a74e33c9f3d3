"""``Outlet``: the last DataPipe of the adapted graph, where items reach the user.

The reading service needs to know exactly how many items the *user* has received this epoch,
and whether the epoch ended (``StopIteration`` was raised to the user). Everything upstream of
the outlet may run ahead (prefetching, threads); the outlet counts only what was handed out.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import IterDataPipe
from torchdata.dataloader2.graph import DataPipe

__all__ = ["Outlet"]


class Outlet(IterDataPipe):
    """Counting pass-through at the end of the graph.

    ``delivered`` is the number of items handed to the user in the current epoch and
    ``finished`` becomes true once ``StopIteration`` reached the user.
    """

    def __init__(self, source_datapipe: DataPipe) -> None:
        self.source_datapipe = source_datapipe
        self.epoch = -1
        self.delivered = 0
        self.finished = False

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.delivered = 0
        self.finished = False

    def __iter__(self) -> Iterator[Any]:
        return _OutletIterator(self, iter(self.source_datapipe), self.epoch)

    def __len__(self) -> int:
        return len(self.source_datapipe)


class _OutletIterator:
    __slots__ = ("outlet", "source", "epoch")

    def __init__(self, outlet: Outlet, source: Iterator[Any], epoch: int) -> None:
        self.outlet = outlet
        self.source: Optional[Iterator[Any]] = source
        self.epoch = epoch

    def __iter__(self) -> _OutletIterator:
        return self

    def __next__(self) -> Any:
        outlet = self.outlet
        if self.source is None or outlet.epoch != self.epoch:
            raise StopIteration
        try:
            item = next(self.source)
        except StopIteration:
            outlet.finished = True
            self.source = None
            raise
        outlet.delivered += 1
        return item
