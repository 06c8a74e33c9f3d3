"""Items as bytes on a pipe: pickled one by one, tensors through shared memory.

:class:`ItemEncoder` pickles a worker's items as ``ForkingPickler`` does for the queue-based loop's queues
(a tensor's storage travels as a shared-memory handle), one item after the other so that a batch
of them can be bounded by bytes, and notes which items share memory with the reader.
:class:`ItemDecoder` reads them back. An :class:`ItemPool` (the tensor pool) may take the
tensors and numpy arrays instead, into slots it recycles.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, List, Optional, Protocol, Tuple

__all__ = ["TRANSPORT_PROTOCOL", "ItemDecoder", "ItemEncoder", "ItemPool"]

#: The pickle protocol of the items: the one multiprocessing's queues use (``ForkingPickler.dumps``
#: passes none), so that what arrives is what the queue-based loop's workers deliver. It decides more than
#: bytes: numpy keeps a read-only array read-only through protocol 5 and gives back a writeable
#: copy through 4, Python's default before 3.14.
TRANSPORT_PROTOCOL = pickle.DEFAULT_PROTOCOL


class ItemPool(Protocol):
    """Shared memory an item's tensors travel through instead of their own segments: what the
    channel asks of the tensor pool (an optional feature: see
    :class:`~torchdata_snapshot.core.plugins.TensorPoolFeature`)."""

    def begin_item(self) -> None:
        """An item is about to be pickled (worker side)."""

    def reduce(self, obj: Any) -> Optional[Tuple[Any, ...]]:
        """The reduction of ``obj`` (any object the pickler meets) copied into the item's slot,
        or ``None``: the usual path."""

    def end_item(self, ok: bool) -> Optional[int]:
        """The slot the item holds, if any (``ok=False``: it is not sent, its slot is freed)."""

    def release(self, slot: int) -> None:
        """Free a slot whose item will never reach the reader."""

    def load(self, stream: io.BytesIO) -> Any:
        """Unpickle the next item of ``stream`` (reader side)."""

    def reclaim(self) -> None:
        """Take back the slots the reader is done with that it could not free when it dropped
        them (reader side, as the sender's items arrive)."""

    def close_fd(self) -> None:
        """Close the descriptor the pool was mapped from (the mapping stays)."""

    def trim(self) -> int:
        """Reader side, once the sender has exited: give back the memory no object of this
        process views (the tensors a user keeps past ``shutdown()``). Returns the bytes given
        back."""


#: The types ``ForkingPickler.register`` was given a reduction for: torch registers tensors and
#: storages, which then travel through shared memory. Registering updates this same dict, so the
#: reference taken at import (before ``import torch``, maybe) stays current.
_SHARED_TYPES = ForkingPickler._extra_reducers  # type: ignore[attr-defined]


#: Items of these exact types hold nothing a pickler shares or pools, and picklers save them
#: without their reducers: ``pickle.dumps`` writes the bytes a ``ForkingPickler`` writes, in a
#: third of the time (a worker of tiny items spends it on every item).
_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})


class _SharingPickler(ForkingPickler):
    """A ``ForkingPickler`` that notes whether it pickled an object it shares with the reader
    instead of copying it into the payload (a tensor's storage in shared memory: an object of a
    type registered with ``ForkingPickler.register``). Called for objects of other than the
    built-in types only, so plain items (numbers, strings, tuples, dicts) cost nothing more."""

    def __init__(self, file: io.BytesIO, pool: Optional[ItemPool] = None) -> None:
        super().__init__(file, TRANSPORT_PROTOCOL)
        self.shared = False
        self.pool = pool

    def reducer_override(self, obj: Any) -> Any:
        if self.pool is not None:
            reduced = self.pool.reduce(obj)  # a tensor or a numpy array, copied into a slot
            if reduced is not None:
                self.shared = True
                return reduced
        if type(obj) in _SHARED_TYPES:
            self.shared = True
        return NotImplemented  # the usual reduction


class ItemEncoder:
    """Pickles items one after the other into one buffer, as ``ForkingPickler`` does for queues.

    Tensors therefore travel through shared memory, exactly as with the queue-based loop's queues. One
    pickler is reused for a whole batch (building a ``ForkingPickler`` costs ~2 us, a ``dump``
    ~0.2 us); its memo is cleared after every item so that items stay independent. ``shared``
    tells whether the item :meth:`dumps` pickled last shares memory with the reader: then its
    payload does not measure its size.

    With a ``pool`` (a worker's :class:`ItemPool`), :meth:`dumps`
    copies the item's tensors into a slot of it where they fit; ``slot`` is then that slot.
    """

    def __init__(self, pool: Optional[ItemPool] = None) -> None:
        self._buffer = io.BytesIO()
        self._pickler = _SharingPickler(self._buffer)
        self._pool = pool
        self.count = 0
        self.slot: Optional[int] = None

    @property
    def shared(self) -> bool:
        return self._pickler.shared

    @property
    def nbytes(self) -> int:
        return self._buffer.tell()

    def add(self, item: Any) -> None:
        """Pickle ``item`` after the previous ones. On error the buffer is left as it was."""
        mark = self._buffer.tell()
        try:
            self._pickler.dump(item)
        except BaseException:
            self._buffer.seek(mark)
            self._buffer.truncate()
            raise
        finally:
            self._pickler.clear_memo()
        self.count += 1

    def dumps(self, item: Any) -> bytes:
        """``item`` alone, pickled as ``add`` would (the batch being built is discarded)."""
        if type(item) in _PLAIN:  # nothing in it to share or pool: the same bytes, faster
            self._pickler.shared = False
            self.slot = None
            return pickle.dumps(item, TRANSPORT_PROTOCOL)
        self._buffer.seek(0)
        self._buffer.truncate()
        self.count = 0
        self._pickler.shared = False
        pool = self._pool
        if pool is not None:
            pool.begin_item()
            self._pickler.pool = pool  # for this item only: add() does not use it
        ok = False
        try:
            self._pickler.dump(item)
            ok = True
        finally:
            self._pickler.clear_memo()
            if pool is not None:
                self._pickler.pool = None
                self.slot = pool.end_item(ok)
        return self._buffer.getvalue()

    def take(self) -> Tuple[int, bytes]:
        """Return ``(count, payload)`` of everything added so far and start a new batch."""
        count, payload = self.count, self._buffer.getvalue()
        self._buffer.seek(0)
        self._buffer.truncate()
        self.count = 0
        return count, payload


class ItemDecoder:
    """Reads back the items an :class:`ItemEncoder` wrote, in order."""

    @staticmethod
    def decode(count: int, payload: bytes, pool: Optional[ItemPool] = None) -> List[Any]:
        """``pool``: the sender's tensor pool, for a payload that may hold pooled tensors."""
        # One unpickler per item: the encoder clears its memo after every item, and an
        # unpickler that outlived an item would number its memo entries differently.
        stream = io.BytesIO(payload)
        if pool is None:
            return [pickle.load(stream) for _ in range(count)]
        return [pool.load(stream) for _ in range(count)]
