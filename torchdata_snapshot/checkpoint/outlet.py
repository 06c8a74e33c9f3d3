"""``ReplayingOutlet``: the core's outlet, extended with what a checkpoint needs of it.

When positions in the workers' streams cannot be told from the user's count (``num_workers=0``,
or a main-process tail that batches or filters), a restore replays the epoch *in the main
process*: the outlet drops the first ``skip`` items of the resumed epoch before handing any out,
and keeps the running digest of what it handed out (see :mod:`torchdata_snapshot.checkpoint.digest`),
which the replay must reproduce.

With ``num_workers=0`` and isolated global RNGs (see
:mod:`torchdata_snapshot.checkpoint.rng_states`), the outlet produces an item when the user asks
for it, as torchdata does (the pipeline's side effects, prints and breakpoints happen in step
with the training loop, and what the loop sets before ``next()`` reaches that item), with the
pipeline's RNG states swapped in for that item only: about 25 us per item. With ``read_ahead``
it amortizes the swap instead: it produces items ahead, up to ``READ_AHEAD_ITEMS``,
``READ_AHEAD_S`` or ``READ_AHEAD_BYTES`` of data at a time, inside one swap, and hands them out
one by one. The data are the same either way (the pipeline's draws are its own, and each item
starts as after a swap of its own:
:meth:`~torchdata_snapshot.checkpoint.rng_states.IsolatedRNG.next_item`), and so are
checkpoints: they count what reached the user.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Deque, Iterator, List, Optional

from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._compat.datapipes import unhooked_iter
from torchdata_snapshot._constants import READ_AHEAD_BYTES, READ_AHEAD_ITEMS, READ_AHEAD_S
from torchdata_snapshot._errors import CheckpointError
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain, chain_hex
from torchdata_snapshot.checkpoint.format import Checkpoint
from torchdata_snapshot.checkpoint.replay import ReplayProgressLog, replay
from torchdata_snapshot.checkpoint.restore_plan import log_refusal
from torchdata_snapshot.checkpoint.rng_states import IsolatedRNG
from torchdata_snapshot.core.main.outlet import Outlet, OutletIterator
from torchdata_snapshot.core.main.positions import UserPositions

__all__ = ["ReplayingOutlet", "data_bytes"]

logger = logging.getLogger(__name__)

#: A replay in the main process reads the clock for its progress log once per this many items.
PROGRESS_CHECK_ITEMS = 256


class ReplayingOutlet(Outlet):
    """An :class:`Outlet` that replays in the main process (see the module docstring).

    Beyond the core's attributes: ``digest`` the running digest of the delivered items
    (main-process replay mode, when verification is on; ``None`` otherwise). As the reading
    service starts it: ``verify`` replays against running digests; ``rng`` the pipeline's
    isolated global RNG states (``num_workers=0``); ``read_ahead`` produce items ahead within one
    swap of them.
    """

    def __init__(
        self,
        source_datapipe: DataPipe,
        positions: Optional[UserPositions] = None,
        *,
        verify: bool = False,
        rng: Optional[IsolatedRNG] = None,
        read_ahead: bool = False,
    ) -> None:
        super().__init__(source_datapipe, positions)
        self.verify = verify
        self.rng = rng
        self.read_ahead = read_ahead
        self._chain: Optional[int] = None
        self._skip = 0
        self._skip_digest: Optional[str] = None
        self._ahead: Deque[Any] = deque()  # the current iterator's items produced ahead

    def start_epoch(
        self,
        epoch: int,
        *,
        delivered: int = 0,
        worker_delivered: Optional[List[int]] = None,
        last_worker: int = -1,
        skip: int = 0,
        skip_digest: Optional[str] = None,
    ) -> None:
        """As the core's; in main-process replay mode a restore passes ``skip`` instead: that
        many items are replayed and dropped here before the first one reaches the user, their
        running digest checked against ``skip_digest``."""
        super().start_epoch(
            epoch, delivered=skip or delivered, worker_delivered=worker_delivered, last_worker=last_worker
        )
        self._chain = CHAIN_START if self.verify and self.positions is None else None
        self._skip, self._skip_digest = skip, skip_digest

    def start_epoch_at(self, epoch: int, resume: Optional[Checkpoint] = None) -> None:
        """Start ``epoch`` afresh, or at the position of the checkpoint ``resume`` taken in it."""
        if resume is None:
            self.start_epoch(epoch)
        elif resume.replay_in_main:
            self.start_epoch(epoch, skip=resume.delivered, skip_digest=resume.digest)
        else:
            num_workers = len(resume.workers)
            self.start_epoch(
                epoch,
                delivered=resume.delivered,
                worker_delivered=[w.delivered for w in resume.workers],
                last_worker=(resume.next_worker - 1) % num_workers if resume.delivered else -1,
            )

    @property
    def digest(self) -> Optional[str]:
        """The running digest of the items delivered this epoch (main-process replay mode)."""
        if self._skip:  # not replayed yet: the one the restore started from
            return self._skip_digest
        return None if self._chain is None or not self.delivered else chain_hex(self._chain)

    def _iter(self) -> Iterator[Any]:
        """With isolated RNGs the source's iterator is created with the pipeline's states: a
        DataPipe may draw as soon as it is iterated."""
        if self.rng is None:
            source = iter(self.source_datapipe)
        else:
            with self.rng.active():
                source = iter(self.source_datapipe)
        iterator = _ReplayingIterator(self, source, self.epoch)
        self._ahead = iterator.ahead
        return iterator

    @property
    def produced_ahead(self) -> int:
        """Items produced ahead of the user (isolated RNGs), not handed out yet."""
        return sum(1 for entry in self._ahead if not isinstance(entry, _End))

    def _replay(self, source: Iterator[Any]) -> None:
        """Drop the ``skip`` items the user already received before the checkpoint; say at INFO
        that the epoch was restored so, and what it took (a long replay logs its progress)."""
        skip, expected, self._skip = self._skip, self._skip_digest, 0
        rng, epoch, progress = self.rng, self.epoch, ReplayProgressLog()

        def on_item(position: int) -> None:
            if rng is not None:
                rng.next_item()
            if not position % PROGRESS_CHECK_ITEMS:  # (the clock is read every so many items)
                progress.report("main process", epoch, position, skip)

        try:
            self._chain = replay(
                source, 0, skip, self._chain, expected, where="main process", epoch=epoch, on_item=on_item
            )
        except CheckpointError as e:
            log_refusal(e, f" while epoch {epoch} was restored")
            raise
        self.delivered = skip
        logger.info(
            "restored epoch %d at item %d by replay in the main process: %d items replayed, in %.3f s",
            epoch,
            skip,
            skip,
            progress.clock() - progress.started,
        )


unhooked_iter(ReplayingOutlet, ReplayingOutlet._iter)


class _End:
    """Where the source ended (``error`` is ``None``) or raised ``error``, in the read-ahead."""

    __slots__ = ("error",)

    def __init__(self, error: Optional[Exception] = None) -> None:
        self.error = error


def data_bytes(item: Any) -> int:
    """The bytes ``item`` holds in tensors, arrays, strings and bytes, at its top level or one
    level down (a sample as a tuple, a list or a dict of them); anything else counts nothing."""
    if isinstance(item, dict):
        return sum(_own_bytes(value) for value in item.values())
    if isinstance(item, (tuple, list)):
        return sum(_own_bytes(value) for value in item)
    return _own_bytes(item)


def _own_bytes(value: Any) -> int:
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    try:
        nbytes = getattr(value, "nbytes", None)  # tensors and numpy arrays
    except Exception:  # a sparse tensor has none; any other object may raise what it wants
        return 0
    return nbytes if isinstance(nbytes, int) else 0


class _ReplayingIterator(OutletIterator):
    """The iterator of a :class:`ReplayingOutlet`'s epoch. Its per-item methods are written out
    rather than extending the core's: they are the hot path of every item the user receives."""

    __slots__ = ("ahead", "replaying")

    def __init__(self, outlet: ReplayingOutlet, source: Iterator[Any], epoch: int) -> None:
        super().__init__(outlet, source, epoch)
        self.replaying = outlet  # (the outlet, typed as what it is)
        self.ahead: Deque[Any] = deque()

    def __next__(self) -> Any:
        outlet = self.replaying
        if outlet.closed or outlet.epoch != self.epoch:
            self._check(outlet)
        rng = outlet.rng
        if rng is not None and outlet.read_ahead:
            return self._next_read_ahead(outlet, rng)
        try:
            if rng is None:
                item = self._produce(outlet)
            else:
                rng.swap_in()  # this one item, with the pipeline's RNG states
                try:
                    item = self._produce(outlet)
                finally:
                    rng.swap_out()
        except StopIteration:
            outlet.finished = True
            raise
        return self._deliver(outlet, item)

    def _next_read_ahead(self, outlet: ReplayingOutlet, rng: IsolatedRNG) -> Any:
        if not self.ahead:
            with rng.active():
                self._read_ahead(outlet, rng)
        entry = self.ahead.popleft()
        if isinstance(entry, _End):
            self.ahead.appendleft(entry)  # every later call ends the same way
            if entry.error is not None:
                raise entry.error
            outlet.finished = True
            raise StopIteration
        return self._deliver(outlet, entry)

    def _read_ahead(self, outlet: ReplayingOutlet, rng: IsolatedRNG) -> None:
        """Produce up to ``READ_AHEAD_ITEMS`` items, as many as ``READ_AHEAD_S`` allows and as
        many of the first one's size as fit in ``READ_AHEAD_BYTES`` (at least one), and where
        the source ends or fails if it does."""
        deadline = time.perf_counter() + READ_AHEAD_S
        limit = READ_AHEAD_ITEMS
        for count in range(READ_AHEAD_ITEMS):
            if count:
                rng.next_item()  # each item starts as after a swap of its own
            try:
                self.ahead.append(self._produce(outlet))
            except StopIteration:
                self.ahead.append(_End())
                return
            except Exception as e:
                self.ahead.append(_End(e))
                return
            if count == 0:
                limit = max(1, min(limit, READ_AHEAD_BYTES // max(1, data_bytes(self.ahead[-1]))))
            if count + 1 >= limit or time.perf_counter() >= deadline:
                return

    def _produce(self, outlet: Outlet) -> Any:
        source = self.source
        if source is None:
            raise StopIteration
        if self.replaying._skip:
            self.replaying._replay(source)
        try:
            return next(source)
        except StopIteration:
            self.source = None
            raise

    def _deliver(self, outlet: Outlet, item: Any) -> Any:
        replaying = self.replaying
        replaying.delivered += 1
        positions = replaying.positions
        if positions is not None:
            positions.deliver_one()
        elif replaying._chain is not None:
            replaying._chain = chain(replaying._chain, item)
        return item
