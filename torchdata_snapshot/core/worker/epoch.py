"""``WorkerEpoch``: what one epoch of a worker's graph has done so far, built anew at each reset."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipeGraph

from torchdata_snapshot._compat.datapipes import samples_yielded
from torchdata_snapshot._constants import NO_EPOCH

__all__ = ["WorkerEpoch"]


@dataclass
class WorkerEpoch:
    """The epoch ``number`` of a worker: its ``iterator`` over the graph (``None`` once the stream
    ended or failed), the ``credit`` the main process granted and not yet used, the items
    ``produced`` (sent, or pending in the outbox), their running ``digest`` (``None``: replay
    verification off), whether the stream is ``exhausted``, and the graph's ``sharding`` filter
    whose position each item carries (see :mod:`torchdata_snapshot.core.messages`), which had
    ``taken_before`` elements before this iteration of it (a restored state's); ``graph``: the
    graph the epoch runs, traversed once at its reset."""

    number: int = NO_EPOCH
    iterator: Optional[Iterator[Any]] = None
    credit: int = 0
    produced: int = 0
    digest: Optional[int] = None
    exhausted: bool = False
    sharding: Optional[ShardingFilterIterDataPipe] = None
    taken_before: int = 0
    graph: DataPipeGraph = field(default_factory=dict)

    def can_produce(self) -> bool:
        return self.iterator is not None and self.credit > 0 and not self.exhausted

    def taken(self) -> Optional[int]:
        """The elements the sharding filter has taken so far this epoch (``None``: no filter)."""
        return None if self.sharding is None else self.taken_before + samples_yielded(self.sharding)

    def end(self) -> None:
        self.exhausted = True
        self.iterator = None
