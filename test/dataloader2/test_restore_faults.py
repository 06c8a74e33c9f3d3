"""Faults around a restore: a worker that died before the checkpoint was taken changes nothing it
records, and a worker killed while it replays a restore ends the run with a clear error within a
bounded time."""

from __future__ import annotations

import os
import signal
import time
import unittest
from typing import Any, List

import pytest
from faults import killing
from pipelines import rs, take, tiny
from suite_case import SuiteTestCase
from torchdata.dataloader2 import DataLoader2

from torchdata_snapshot import WorkerDiedError

BOUND_S = 30.0  # generous: every fault must surface well within this


def reference_of(datapipe: Any, make_dl: Any) -> List[Any]:
    return list(make_dl(datapipe, rs(2)))


class TestRestoreFaults(SuiteTestCase):
    def test_state_dict_after_a_worker_died_is_still_exact(self) -> None:
        # state_dict() asks no worker: it records what the user received, which a death cannot change.
        # More items than the workers may run ahead (small items: up to 512 each): worker 0 has
        # items left when it is killed.
        reference = reference_of(tiny(3000), self.make_dl)
        dl = self.make_dl(tiny(3000), rs(2))
        it = iter(dl)
        head = take(it, 11)
        os.kill(dl.reading_service.snapshot()[0].pid, signal.SIGKILL)
        state = dl.state_dict()
        with pytest.raises(WorkerDiedError, match="worker 0"):
            list(it)
        again = DataLoader2.from_state(state, rs(2))
        try:
            assert head + list(again) == reference
        finally:
            again.shutdown()

    def test_a_worker_killed_while_replaying_a_restore(self) -> None:
        # Without captured states (stateful=False) the replay starts at the epoch's beginning: a
        # state captured after item 15 (captures are paced by time) would let it skip that item.
        dl = self.make_dl(killing(self.tmp_path / "absent", 15), rs(2, stateful=False))
        take(iter(dl), 40)  # the replay of worker 1 passes item 15
        state = dl.state_dict()
        assert all(w["state"] is None for w in state["reading_service_state"]["workers"])
        (self.tmp_path / "absent").touch()
        again = DataLoader2.from_state(state, rs(2, stateful=False))
        start = time.monotonic()
        try:
            with pytest.raises(WorkerDiedError, match=r"worker 1 .* exit code -9"):
                list(again)
        finally:
            again.shutdown()
        assert time.monotonic() - start < BOUND_S


if __name__ == "__main__":
    unittest.main()
