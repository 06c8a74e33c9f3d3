"""``SlotLedger``: which tensor pool slots the main process lent out, and which a fork may read.

NOTE [ Tensor pool leases and forks ]
=====================================

The lifetime rule (NOTE [ Tensor pool ] in :mod:`torchdata_snapshot.tensor_pool.pool`) says a slot
returns to its worker when the last tensor viewing it is freed. A process forked from the main
process while such a tensor lived (an asynchronous checkpoint writer, a logging process, the
workers of another loader) has that tensor too, in memory it shares with the pool: were the slot
to return to the worker when the *main process* drops its tensor, the worker would write a later
item into it and the child would read that item's values. So a fork *holds* every slot leased at
the time, until every process that may have it has exited:

* **Leases.** Each pool's ledger notes the slots whose tensors live in this process (``leased``:
  set when the item is unpickled, cleared when the lease's finalizer runs).
* **A fork.** ``os.register_at_fork`` hooks, in the process that owns the ledgers. Before the fork
  a pipe is made and ``forking`` counts the fork as under way; after it, the parent closes its
  write end and every slot leased then, or dropped while the fork was under way
  (``window_dropped``: the tensor may have died after the child was made), gets one more hold;
  the child keeps the write end. The pipe reads as end-of-file once every process that has the
  write end (the child and the processes it forked in turn) has exited or exec'd.
* **A drop.** The lease's finalizer frees the slot at once unless it is held or a fork is under
  way; else the slot waits in ``pending``, and is freed by whoever finds it pending, unheld and
  no fork under way: the finalizer itself, the end-of-file of the last fork holding it
  (:meth:`ForkWatch.reap`, called by the main process each time a worker's items arrive), or the
  end of the fork that was under way. Finalizers run in whichever thread drops a tensor, from a
  garbage collection too, so they take no lock: a finalizer running means the tensor is already
  dead, and a fork that starts after it cannot copy it. The hooks and ``reap`` take the lock.
* **The reading service's own processes.** Workers and the dispatching process, started inside
  :func:`~torchdata_snapshot.core.plugins.own_process_start`, read none of the user's tensors:
  their forks hold nothing.

What it costs: nothing per item while no process forked from this one lives; one ``poll`` per
batch of items while some do. A fork holds at most the slots leased at the time (the user's
items and the main process's prefetched ones); forked processes that live long (or forked
repeatedly, each living long) may hold every slot, and then items take the usual path until they
exit: the pool never waits and never fails for it. What it cannot see: a process forked by C code
without Python's fork hooks (nothing is held for it), and a child that closes the descriptors it
inherited while it keeps the tensors (a daemonizing library: its slots return when it closes
them). A fork made while no descriptor is left holds its slots for good.
"""

from __future__ import annotations

import os
import select
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from torchdata_snapshot.core.plugins import starting_own_process

__all__ = ["FORKS", "ForkWatch", "SlotLedger"]

_FREE = 0


class SlotLedger:
    """The main process's account of one pool's slots; ``flags`` is the pool's flag bytes.

    Invariants: ``holds[s]`` is the number of forks holding slot ``s`` whose pipe has not been
    seen closed (changed under the watch's lock only); ``s in pending`` iff its tensors were
    dropped while it was held or a fork was under way, and its flag is not cleared yet. A pending
    slot is freed (claimed) only while no fork is under way.
    """

    __slots__ = (
        "__weakref__", "flags", "holds", "leased", "owner_pid", "pending", "views", "window_dropped",
    )  # fmt: skip

    def __init__(self, flags: memoryview) -> None:
        self.flags = flags
        self.owner_pid = os.getpid()
        self.leased = bytearray(len(flags))
        self.holds = [0] * len(flags)
        self.pending: Set[int] = set()
        self.window_dropped: Set[int] = set()
        # Per leased slot, what its item's storages are and where they view it (see live_ranges).
        self.views: Dict[int, List[Tuple[weakref.ref, int, int]]] = {}
        FORKS.register(self)

    def lease(self, slot: int) -> None:
        self.leased[slot] = 1
        self.views[slot] = []  # the slot's previous item is gone: it was freed

    def viewed(self, slot: int, storage: Any, offset: int, nbytes: int) -> None:
        """A storage of ``slot``'s item views ``nbytes`` bytes at ``offset`` of it."""
        self.views[slot].append((weakref.ref(storage), offset, nbytes))

    def live_ranges(self, slot: int) -> List[Tuple[int, int]]:
        """``(offset, nbytes)`` within ``slot`` of its item's storages that live (a tensor's
        storage lives as long as any tensor or array viewing it: see ``storages_outlive_handles``)."""
        return [(offset, nbytes) for ref, offset, nbytes in self.views.get(slot, ()) if ref() is not None]

    def drop(self, slot: int) -> None:
        """The last tensor viewing ``slot`` was freed (its lease's finalizer): free the slot, or
        keep it for the forks that may still read it. Takes no lock (see the module NOTE)."""
        if os.getpid() != self.owner_pid:
            return  # a forked process collecting what it inherited: the slot is not its own
        forking = FORKS.forking  # read before holds: see ForkWatch.after_fork
        if not forking and not self.holds[slot]:
            self.leased[slot] = 0
            self.flags[slot] = _FREE
            return
        self.pending.add(slot)  # before leased is cleared: a fork's scan sees one or the other
        if forking:
            self.window_dropped.add(slot)
        self.leased[slot] = 0
        if not FORKS.forking and not self.holds[slot]:
            self.claim(slot)  # the forks ended meanwhile

    def claim(self, slot: int) -> None:
        """Free ``slot`` if it is pending; of two threads that try, one frees it."""
        try:
            self.pending.remove(slot)
        except KeyError:
            return
        self.window_dropped.discard(slot)
        self.flags[slot] = _FREE

    def claim_unheld(self) -> None:
        for slot in list(self.pending):
            if not self.holds[slot]:
                self.claim(slot)


@dataclass(frozen=True)
class _Hold:
    """What one fork holds: per ledger (weakly: a pool nobody uses any more needs nothing), the
    slots it may read. ``fd`` is the read end of its pipe."""

    fd: int
    slots: Tuple[Tuple[weakref.ref, Tuple[int, ...]], ...]


class ForkWatch:
    """The fork hooks and the holds of one process (see the module NOTE); one per process, made
    again in a forked child, which owns none of its parent's ledgers."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.lock = threading.Lock()
        self.forking = 0  # forks of the user's under way (between the before and after hooks)
        self.ledgers: weakref.WeakSet[SlotLedger] = weakref.WeakSet()
        self.holds: Dict[int, _Hold] = {}  # by the read end of the fork's pipe
        self._poll: Optional[select.poll] = None
        self._local = threading.local()  # per forking thread: its fork under way, its pipe

    def register(self, ledger: SlotLedger) -> None:
        self.ledgers.add(ledger)

    # --- the hooks --------------------------------------------------------------------------------

    def before_fork(self) -> None:
        self._local.under_way, self._local.pipe = False, None
        if starting_own_process() or not self._owned():
            return
        try:
            self._local.pipe = os.pipe()  # not inheritable: an exec closes the child's end
        except OSError:  # out of descriptors: the child cannot be watched, its slots stay held
            self._local.pipe = None
        with self.lock:
            self.forking += 1
        self._local.under_way = True

    def after_fork(self) -> None:
        """In the parent: hold every slot leased now or dropped while the fork was under way."""
        if not getattr(self._local, "under_way", False):
            return
        pipe, self._local.under_way, self._local.pipe = self._local.pipe, False, None
        if pipe is not None:
            os.close(pipe[1])
        held: List[Tuple[weakref.ref, Tuple[int, ...]]] = []
        with self.lock:
            for ledger in self._mine():
                slots = {s for s, leased in enumerate(ledger.leased) if leased} | ledger.window_dropped
                for slot in slots:
                    ledger.holds[slot] += 1
                if slots:
                    held.append((weakref.ref(ledger), tuple(sorted(slots))))
            # After the holds: a finalizer that reads forking == 0 now reads them too.
            self.forking -= 1
            if held and pipe is not None:
                self.holds[pipe[0]] = _Hold(pipe[0], tuple(held))
                self._poller().register(pipe[0], select.POLLIN)
            if not self.forking:
                for ledger in self._mine():
                    ledger.window_dropped.clear()
                    ledger.claim_unheld()
        if pipe is not None and not held:
            os.close(pipe[0])

    def after_fork_in_child(self) -> None:
        """In the child: it owns no ledger; it keeps the write end of its own fork's pipe (that
        is what tells the parent it lives) and closes the read ends it inherited."""
        for fd in self.holds:
            _close(fd)
        pipe = getattr(self._local, "pipe", None)
        if pipe is not None:
            _close(pipe[0])  # the write end stays open as long as this process lives
        self._reset()  # a fresh lock too: another thread of the parent may have held it

    # --- the main process -------------------------------------------------------------------------

    def reap(self) -> None:
        """Release the holds of forks whose processes have all exited. Cheap while none lives."""
        if not self.holds:
            return
        with self.lock:
            for fd, _ in self._poller().poll(0):  # nobody writes: readable means end-of-file
                hold = self.holds.pop(fd, None)
                if hold is None:
                    continue
                self._poller().unregister(fd)
                _close(fd)
                for ref, slots in hold.slots:
                    ledger = ref()
                    if ledger is None:
                        continue
                    for slot in slots:
                        ledger.holds[slot] -= 1
                    if not self.forking:
                        ledger.claim_unheld()

    def _owned(self) -> bool:
        return any(True for _ in self._mine())

    def _mine(self) -> Iterator[SlotLedger]:
        pid = os.getpid()
        return (ledger for ledger in list(self.ledgers) if ledger.owner_pid == pid)

    def _poller(self) -> select.poll:
        if self._poll is None:
            self._poll = select.poll()
        return self._poll


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


#: This process's watch. The fork hooks are process-wide by nature (``os.register_at_fork``); the
#: ledgers it watches are the pools' own, registered weakly.
FORKS = ForkWatch()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: FORKS.before_fork(),
        after_in_parent=lambda: FORKS.after_fork(),
        after_in_child=lambda: FORKS.after_fork_in_child(),
    )
