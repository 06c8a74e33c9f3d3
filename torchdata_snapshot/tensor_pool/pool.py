"""``TensorPool``: recycled shared memory through which a worker's tensors reach the main process.

NOTE [ Tensor pool ]
====================

Without it, every tensor an item holds gets a fresh shared-memory segment in the worker and its
file descriptor travels through torch's resource sharer (``ForkingPickler``): page faults on new
memory and a descriptor round trip per tensor, about 0.1-0.8 GB/s. With it
(on by default where the platform has it, Linux: see :func:`unavailable`):

* **Layout.** The main process creates one pool per worker process it starts: an unlinked
  ``memfd`` (nothing ever exists in /dev/shm), mapped in both processes. It starts with one flag
  byte per slot, then ``slots`` slots of ``max_slot_bytes`` each. Under ``fork`` the worker inherits
  the mapping; under ``spawn``/``forkserver`` the descriptor travels with the process's
  arguments (``multiprocessing.reduction.DupFd``) and the worker maps it. The main process
  closes its descriptor once the worker started: the memory lives as long as a mapping does.
* **Writing (worker).** When the worker pickles an item, the first tensor that qualifies
  (exactly ``torch.Tensor``, on the CPU, strided, contiguous, without autograd, conjugate or
  negative bits, not quantized, not empty) or numpy array (exactly ``numpy.ndarray``,
  C-contiguous, not empty, holding no Python objects) takes the lowest free slot (flag 0 -> 1);
  it and the item's next qualifying tensors and arrays are copied into the slot, 64-byte
  aligned, and pickled as ``(slot, offset, size, dtype, shape)`` and what a pickle would keep
  besides: a tensor's strides (where a size-1 dimension makes them unusual), an array's
  read-only flag where the items' pickle protocol keeps it (numpy's pickle gives C strides).
  One that does not fit in what is left of the slot, one that does not qualify, and all of an
  item's when no slot is free take the usual path (``ForkingPickler``): a worker never waits for a slot.
* **Reading (main).** The item is unpickled with the stream's pool: each of its tensors is a
  ``torch.frombuffer`` tensor (each array a numpy view of one) over its own bytes of one
  memoryview of the slot, which its storage keeps alive. No copy is made: the user's
  tensors *are* the slot; yet a tensor's storage is its own bytes, so ``torch.save`` writes
  what it holds, not the whole slot.
* **The lifetime rule.** The slot returns to its worker when the last tensor (or array) viewing
  it is freed: a ``weakref.finalize`` on the memoryview (the object their storages hold) writes the
  slot's flag back to 0, from whichever thread dropped the last reference. Until then the
  worker never writes the slot again, however long the user keeps the tensor. The flags are
  the only shared state, each byte has one writer per transition (the worker sets, the main
  process clears), and a pipe message orders every write of a slot before its reading. Only
  the main process clears: a process forked from it (a worker started or restarted later)
  inherits its tensors and their finalizers, and a collection there frees nothing.
* **Forks.** A process the user forks while a tensor lives (an asynchronous checkpoint writer)
  has that tensor too, in the same memory: the slot then returns to its worker only once the
  main process has freed the tensor *and* every process forked while it lived has exited (see
  NOTE [ Tensor pool leases and forks ] in :mod:`torchdata_snapshot.tensor_pool.leases`). The
  reading service's own processes (workers, the dispatching process) read none of the user's
  tensors, and their forks hold nothing.
* **Sizes.** A slot's memory is the pages its items wrote: the memfd is sparse, so what a pool
  holds is, per slot, the largest item that went through it (rounded up to pages), never more
  than ``max_slot_bytes`` (``tensor_pool_slot_bytes``, 64 MiB by default) per slot. The worker
  places an item's tensors within ``slot_bytes`` of its slot, a limit that starts at
  ``TENSOR_POOL_START_SLOT_BYTES`` (1 MiB): an item whose tensors do not all fit sends those that
  do not the usual path, and the limit grows, for later items, to twice what it was or to what
  the item needed, whichever is more, up to ``max_slot_bytes``; an item larger than that always
  takes the usual path. The limit is the worker's own (nothing else reads it); the main process
  reads each item's tensors where the pickle says they are.
* **Bounds.** Items in flight are bounded by credit as before (a pooled item counts as holding
  shared memory: the window stays at the prefetch counts); slots are ``2 x`` the window (at
  least 4), so they cover the window plus as many items held downstream; when the user holds
  more, items take the usual path until slots come back.
* **Lost slots.** A slot whose item never reaches the main process (dropped by an epoch reset
  in the worker's outbox) is freed by the worker. A worker that dies, or is replaced by
  self-healing, leaves its pool behind: the replacement gets a new one, and the old one is
  unmapped once the main process drops its last view of it (nothing to clean up: an unlinked
  memfd has no name). Shutdown drops the pools the same way.

The checkpoint, replay and digests see the same tensors: the worker digests the item it
produced, and the bytes the main process views are a copy of them.
"""

from __future__ import annotations

import functools
import gc
import io
import mmap
import os
import pickle
import sys
import weakref
from multiprocessing.reduction import DupFd
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from torchdata_snapshot._constants import ALIGN_BYTES
from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot.core.options import TensorPoolOptions
from torchdata_snapshot.core.transport.item_codec import TRANSPORT_PROTOCOL
from torchdata_snapshot.tensor_pool.leases import FORKS, SlotLedger

__all__ = ["TensorPool", "pooled_array", "pooled_tensor"]


_PAGE = mmap.PAGESIZE
_FREE, _TAKEN = 0, 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def pooled_tensor(*args: Any) -> Any:
    """Stands in a pickle for a tensor in a pool slot; only a pool's unpickler resolves it."""
    raise ProtocolError("a tensor pickled into a tensor pool slot was unpickled without its pool")


def pooled_array(*args: Any) -> Any:
    """Stands in a pickle for a numpy array in a pool slot; only a pool's unpickler resolves it."""
    raise ProtocolError("a numpy array pickled into a tensor pool slot was unpickled without its pool")


def _array_qualifies(a: Any) -> bool:
    """Exactly ``numpy.ndarray`` (no subclass), C-contiguous, not empty, holding no objects. The
    type is looked up only if numpy was imported: else no item can hold an array."""
    numpy = sys.modules.get("numpy")
    return (
        numpy is not None
        and type(a) is numpy.ndarray
        and a.flags.c_contiguous
        and a.nbytes > 0
        and not a.dtype.hasobject
    )


@functools.cache
def _pickle_keeps_read_only() -> bool:
    """Whether a read-only array pickled as items are (``TRANSPORT_PROTOCOL``) comes back
    read-only: a pooled array arrives with the flag the usual path would give it."""
    import numpy

    array = numpy.zeros(1)
    array.flags.writeable = False
    return not pickle.loads(pickle.dumps(array, TRANSPORT_PROTOCOL)).flags.writeable


def _bytes_of(obj: Any) -> memoryview:
    """The bytes of a qualifying tensor or array, flat, without a copy."""
    if type(obj) is torch.Tensor:
        try:
            obj = obj.numpy()
        except TypeError:  # a dtype numpy lacks (bfloat16, float8 types)
            obj = obj.reshape(-1).view(torch.uint8).numpy()
    return memoryview(obj.reshape(-1).view(sys.modules["numpy"].uint8))


def _qualifies(t: Any) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_nested  # strided too, but its storage holds several tensors' data
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
        and t.numel() > 0
    )


def _odd_strides(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The strides of contiguous ``t`` if they are not the ones ``view(shape)`` gives (a dimension
    of size 1 may have any stride), else ``None``."""
    shape = t.shape
    if 1 not in shape:
        return None  # contiguous without a size-1 dimension: the strides are the usual ones
    stride, expected = t.stride(), 1
    for size, got in zip(reversed(shape), reversed(stride)):
        if got != expected:  # a dimension of size 1: ``t`` is contiguous
            return tuple(stride)
        expected *= size
    return None


class TensorPool:
    """One worker's pool (see NOTE [ Tensor pool ] above); created in the main process."""

    def __init__(self, options: TensorPoolOptions, fd: Optional[int] = None) -> None:
        self.options = options
        self.slots = options.slots
        self.max_slot_bytes = _round_up(options.max_slot_bytes, _PAGE)  # the slots' stride
        # The worker's limit on an item's bytes in its slot (grows, see "Sizes" above).
        self.slot_bytes = min(_round_up(options.slot_bytes, _PAGE), self.max_slot_bytes)
        self._header = _round_up(self.slots, _PAGE)
        size = self._header + self.slots * self.max_slot_bytes  # sparse: pages are used as written
        created = fd is None
        if fd is None:
            fd = os.memfd_create("torchdata_snapshot tensor pool", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
        self.fd: Optional[int] = fd
        self._map = mmap.mmap(fd, size)
        self._view = memoryview(self._map)
        self._flags = self._view[: self.slots]
        # The main process's account of the slots it lends (the pool is made there, a worker maps
        # the descriptor it is given).
        self._ledger = SlotLedger(self._flags) if created else None
        # The item being pickled (worker side): its slot, the bytes used in it, and whether no
        # slot was free for it.
        self._slot: Optional[int] = None
        self._used = 0
        self._exhausted = False
        self._wanted = 0  # the bytes the item's qualifying tensors would need in one slot

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why this platform cannot have a pool (``None``: it can): it needs ``os.memfd_create``."""
        if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
            return None
        return f"the tensor pool needs Linux (os.memfd_create), and this platform is {sys.platform}"

    def __reduce__(self) -> Tuple[Any, ...]:
        # Only while a spawn/forkserver process starts: the descriptor goes with its arguments.
        if self.fd is None:
            raise ProtocolError("a tensor pool can only be sent to the worker it was made for, as it starts")
        return (_attach, (DupFd(self.fd), self.options))

    def close_fd(self) -> None:
        """The main process, once the worker started (or in the worker, once mapped): the
        mappings keep the memory."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # --- worker side ----------------------------------------------------------------------------

    def free_slots(self) -> int:
        return bytes(self._flags).count(_FREE)

    def begin_item(self) -> None:
        self._slot, self._used, self._exhausted, self._wanted = None, 0, False, 0

    def end_item(self, ok: bool) -> Optional[int]:
        """The slot the item just pickled holds (``None``: none). ``ok=False``: the item is not
        sent after all, and its slot is freed. An item whose tensors did not all fit grows the
        limit for later items (see "Sizes" in NOTE [ Tensor pool ])."""
        if self._wanted > self.slot_bytes and self.slot_bytes < self.max_slot_bytes:
            grown = max(2 * self.slot_bytes, _round_up(self._wanted, _PAGE))
            self.slot_bytes = min(grown, self.max_slot_bytes)
        slot, self._slot = self._slot, None
        if slot is not None and not ok:
            self.release(slot)
            return None
        return slot

    def release(self, slot: int) -> None:
        """Free a slot whose item will never reach the main process."""
        self._flags[slot] = _FREE

    def reduce(self, obj: Any) -> Optional[Tuple[Any, ...]]:
        """The reduction of ``obj`` copied into the item's slot if it is a tensor or a numpy array
        that qualifies and fits, else ``None``: the usual path."""
        if self._exhausted:
            return None
        # What the pickle would keep beyond dtype and shape: a tensor's strides where a dimension
        # of size 1 makes them other than the contiguous ones, an array's read-only flag
        # (numpy's own pickle gives C strides: an array's are always those).
        extra: Any
        if _qualifies(obj):
            kind, nbytes, shape = pooled_tensor, obj.numel() * obj.element_size(), tuple(obj.shape)
            extra = _odd_strides(obj)
        elif _array_qualifies(obj):
            kind, nbytes, shape = pooled_array, obj.nbytes, obj.shape
            extra = not obj.flags.writeable and _pickle_keeps_read_only()
        else:
            return None
        placed = self._place(nbytes)
        if placed is None:
            return None
        slot, offset = placed
        start = self._header + slot * self.max_slot_bytes + offset
        self._view[start : start + nbytes] = _bytes_of(obj)  # one memcpy
        return (kind, (slot, offset, nbytes, obj.dtype, shape, extra))

    def _place(self, nbytes: int) -> Optional[Tuple[int, int]]:
        """``(slot, offset)``: where the item's next ``nbytes`` go (taking a slot for its first),
        or ``None`` if they do not fit or no slot is free."""
        self._wanted = _round_up(self._wanted, ALIGN_BYTES) + nbytes
        offset = _round_up(self._used, ALIGN_BYTES)
        if offset + nbytes > self.slot_bytes:
            return None
        if self._slot is None:
            self._slot = self._acquire()
            if self._slot is None:
                self._exhausted = True
                return None
        self._used = offset + nbytes
        return self._slot, offset

    def _acquire(self) -> Optional[int]:
        slot = bytes(self._flags).find(b"\x00")  # the lowest: the same few slots stay in cache
        if slot < 0:
            return None
        self._flags[slot] = _TAKEN
        return slot

    def _slot_view(self, slot: int) -> memoryview:
        start = self._header + slot * self.max_slot_bytes
        return self._view[start : start + self.max_slot_bytes]

    # --- main side ------------------------------------------------------------------------------

    def load(self, stream: io.BytesIO) -> Any:
        """Unpickle the next item of ``stream``, its pooled tensors as views of their slot."""
        return _PoolUnpickler(stream, self).load()

    def lease(self, slot: int) -> memoryview:
        """The memory of ``slot``, to build its tensors on; the slot is freed when the last tensor
        built on it is, and every process forked while it lived has exited (the lifetime rule of
        NOTE [ Tensor pool ])."""
        ledger = self._ledger
        if ledger is None:
            raise ProtocolError("a tensor pool lends its slots in the process that made it only")
        view = self._slot_view(slot)
        ledger.lease(slot)
        weakref.finalize(view, ledger.drop, slot).atexit = False
        return view

    def viewed(self, slot: int, storage: Any, offset: int, nbytes: int) -> None:
        """Note that ``storage`` views ``nbytes`` at ``offset`` of leased ``slot`` (for :meth:`trim`)."""
        assert self._ledger is not None
        self._ledger.viewed(slot, storage, offset, nbytes)

    def reclaim(self) -> None:
        """Free the slots whose last reader was a forked process that has exited since."""
        FORKS.reap()

    def trim(self) -> int:
        """Once the worker has exited: give its memfd back the pages no storage of this process
        views (``MADV_REMOVE``), so that a tensor kept past ``shutdown()`` holds its own pages
        rather than the whole pool. A slot a fork holds is kept whole (the fork may read it), and
        so is a leased one where torch cannot tell which storages live."""
        ledger = self._ledger
        if ledger is None or not hasattr(mmap, "MADV_REMOVE"):
            return 0
        track = storages_outlive_handles()
        given = 0
        for slot in range(self.slots):
            if ledger.holds[slot] or slot in ledger.pending or (ledger.leased[slot] and not track):
                continue
            start = self._header + slot * self.max_slot_bytes
            kept = ledger.live_ranges(slot) if ledger.leased[slot] else []
            for lo, hi in _unviewed_pages(start, self.max_slot_bytes, kept):
                self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
                given += hi - lo
        return given

    @property
    def slots_held_for_forks(self) -> int:
        """Slots the main process dropped that wait for processes forked while their tensors
        lived to exit (see NOTE [ Tensor pool leases and forks ])."""
        return 0 if self._ledger is None else len(self._ledger.pending)


class _PoolUnpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, pool: TensorPool) -> None:
        super().__init__(stream)
        # Not a bound method: the unpickler's memo keeps what find_class returns, and a cycle
        # through the unpickler would keep the item's tensors (and their slot) until a collection.
        self._rebuild_tensor, self._rebuild_array = _rebuilders(pool)

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__:
            if name == "pooled_tensor":
                return self._rebuild_tensor
            if name == "pooled_array":
                return self._rebuild_array
        return super().find_class(module, name)


def _rebuilders(pool: TensorPool) -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """The tensors and numpy arrays of one item, built on their slot's lease. Each has a storage
    (a buffer) of its own bytes, which holds the lease: what ``torch.save`` or a pickle of it
    writes is its size, not its slot's."""
    leases: Dict[int, memoryview] = {}

    def own_bytes(slot: int, offset: int, nbytes: int) -> torch.Tensor:
        view = leases.get(slot)
        if view is None:
            view = leases[slot] = pool.lease(slot)
        tensor = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
        pool.viewed(slot, tensor.untyped_storage(), offset, nbytes)
        return tensor

    def rebuild_tensor(
        slot: int, offset: int, nbytes: int, dtype: Any, shape: Tuple[int, ...], stride: Any
    ) -> Any:
        flat = own_bytes(slot, offset, nbytes).view(dtype)
        return flat.view(shape) if stride is None else flat.as_strided(shape, stride)

    def rebuild_array(
        slot: int, offset: int, nbytes: int, dtype: Any, shape: Tuple[int, ...], readonly: bool
    ) -> Any:
        # Through a tensor: numpy.frombuffer would hold a memoryview of its own, not the lease,
        # and the slot would be freed while the array views it.
        array = own_bytes(slot, offset, nbytes).numpy().view(dtype).reshape(shape)
        if readonly:
            array.flags.writeable = False  # as the usual path gives it back
        return array

    return rebuild_tensor, rebuild_array


def _unviewed_pages(start: int, size: int, kept: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The page-aligned ranges of ``[start, start + size)`` outside the pages that the ranges
    ``kept`` (``(offset, nbytes)`` from ``start``) touch."""
    gaps, at = [], start
    for offset, nbytes in sorted(kept):
        lo = start + offset // _PAGE * _PAGE
        if lo > at:
            gaps.append((at, lo))
        at = max(at, _round_up(start + offset + nbytes, _PAGE))
    if start + size > at:
        gaps.append((at, start + size))
    return gaps


@functools.cache
def storages_outlive_handles() -> bool:
    """Whether a storage's Python object lives exactly as long as some tensor uses the storage,
    though nobody holds the object (torch preserves it): then a weak reference to it tells
    whether a tensor still views the storage's bytes. Checked once on this torch."""
    data = bytearray(8)
    tensor = torch.frombuffer(data, dtype=torch.uint8)
    ref = weakref.ref(tensor.untyped_storage())
    view = tensor[2:]
    del tensor
    gc.collect()
    alive = ref() is not None
    del view
    gc.collect()
    return alive and ref() is None


def _attach(fd: Any, options: TensorPoolOptions) -> TensorPool:
    """In a spawned worker: map the pool whose descriptor came with the process's arguments."""
    pool = TensorPool(options, fd=fd.detach())
    pool.close_fd()
    return pool
