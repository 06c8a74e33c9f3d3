"""SlotLedger and the fork hooks (NOTE [ Tensor pool leases and forks ]): a slot the main process
dropped returns to its worker at once, unless a process forked while it was leased may still
read it; then it returns once every such process has exited. Slots here are flag bytes as a
worker sets them; ``lease``/``drop`` are what unpickling an item and freeing its last tensor call.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import unittest
from typing import Tuple
from unittest import TestCase

import pytest
from pipelines import FORK_CHILD_WAIT_S

from torchdata_snapshot.core.plugins import own_process_start
from torchdata_snapshot.tensor_pool.leases import FORKS, SlotLedger

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")


def leased(slots: int = 2) -> Tuple[SlotLedger, memoryview]:
    """A ledger whose slots the worker has all taken (flag 1) and the main process leased."""
    flags = memoryview(bytearray([1] * slots))
    ledger = SlotLedger(flags)
    for slot in range(slots):
        ledger.lease(slot)
    return ledger, flags


class Child:
    """A process forked from this one (as a checkpoint writer is) that lives until told to exit:
    it has the leased memory, whether or not it reads it."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._go = ctx.Event()
        self.process = ctx.Process(target=self._go.wait, args=(FORK_CHILD_WAIT_S,), daemon=True)
        self.process.start()

    def exit(self) -> None:
        self._go.set()
        self.process.join(FORK_CHILD_WAIT_S)
        assert self.process.exitcode == 0
        FORKS.reap()  # as the main process does when the next items arrive


def fork_under_way() -> int:
    """Run the before-fork hook as ``os.fork`` does; return a descriptor standing for the child's
    end of its pipe (this thread's, as the hook keeps it)."""
    FORKS.before_fork()
    return os.dup(FORKS._local.pipe[1])


def exit_code(pid: int, timeout_s: float = FORK_CHILD_WAIT_S) -> int:
    """Wait (bounded) for child ``pid`` to exit and reap it."""
    fd = os.pidfd_open(pid)
    try:
        if not select.select([fd], [], [], timeout_s)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"forked child {pid} did not exit within {timeout_s} s")
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


class TestPoolLeases(TestCase):
    def test_a_slot_leased_at_a_fork_returns_once_dropped_and_the_child_exited(self) -> None:
        ledger, flags = leased()
        child = Child()
        try:
            ledger.drop(0)
            assert bytes(flags) == b"\x01\x01" and ledger.pending == {0}  # the child may read it
            FORKS.reap()
            assert bytes(flags) == b"\x01\x01"
        finally:
            child.exit()
        assert bytes(flags) == b"\x00\x01" and not ledger.pending
        ledger.drop(1)  # held by the same fork, released with it: freed at once now
        assert bytes(flags) == b"\x00\x00"

    def test_a_slot_dropped_after_the_child_exited_returns_at_once(self) -> None:
        ledger, flags = leased()
        Child().exit()
        ledger.drop(0)
        assert bytes(flags) == b"\x00\x01"

    def test_a_slot_held_by_two_forks_returns_when_both_have_exited(self) -> None:
        ledger, flags = leased()
        first = Child()
        second = Child()
        ledger.drop(0)
        try:
            first.exit()
            assert flags[0] == 1  # the second may still read it
        finally:
            second.exit()
        assert flags[0] == 0

    def test_a_fork_holds_only_what_was_leased_when_it_forked(self) -> None:
        ledger, flags = leased()
        ledger.drop(0)
        child = Child()
        try:
            flags[0] = 1  # the worker takes the slot again, for an item leased after the fork
            ledger.lease(0)
            ledger.drop(0)
            assert flags[0] == 0
        finally:
            child.exit()

    def test_the_reading_services_own_starts_hold_nothing(self) -> None:
        """A worker the reading service forks reads none of the user's tensors."""
        ledger, flags = leased()
        with own_process_start():
            child = Child()
        try:
            ledger.drop(0)
            assert flags[0] == 0 and not ledger.pending
        finally:
            child.exit()

    def test_a_slot_dropped_while_a_fork_is_under_way_is_held_by_it(self) -> None:
        ledger, flags = leased()
        child_end = fork_under_way()
        ledger.drop(0)  # another thread: the child may have been made while the tensor lived
        assert flags[0] == 1
        FORKS.after_fork()
        FORKS.reap()
        assert flags[0] == 1 and ledger.pending == {0}
        os.close(child_end)  # the child exits
        FORKS.reap()
        assert flags[0] == 0 and not ledger.pending

    def test_a_slot_leased_while_a_fork_is_under_way_is_held_by_it(self) -> None:
        ledger, flags = leased(1)
        ledger.drop(0)
        flags[0] = 1
        child_end = fork_under_way()
        ledger.lease(0)  # another thread unpickled an item: the child may have it
        FORKS.after_fork()
        ledger.drop(0)
        assert flags[0] == 1
        os.close(child_end)
        FORKS.reap()
        assert flags[0] == 0

    def test_a_fork_that_made_no_child_holds_nothing_once_reaped(self) -> None:
        ledger, flags = leased()
        FORKS.before_fork()
        FORKS.after_fork()  # os.fork failed: nobody has the write end
        FORKS.reap()
        ledger.drop(0)
        assert flags[0] == 0

    def test_a_forked_child_owns_none_of_its_parents_holds_and_ledgers_of_its_own(self) -> None:
        ledger, flags = leased()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                inherited = not FORKS.holds and FORKS.forking == 0 and not list(FORKS._mine())
                ledger.drop(0)  # a collection of what it inherited frees nothing of the parent's
                own, own_flags = leased(1)  # the child runs a loader of its own
                own.drop(0)
                code = 0 if inherited and flags[0] == 1 and own_flags[0] == 0 else 2
            finally:
                os._exit(code)
        assert exit_code(pid) == 0
        FORKS.reap()
        ledger.drop(0)
        assert flags[0] == 0


if __name__ == "__main__":
    unittest.main()
