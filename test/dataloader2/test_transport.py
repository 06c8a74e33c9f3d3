"""Transport: batched messages and credit never change order or counts; stuck workers are found."""

from __future__ import annotations

import os
import time
import unittest
from functools import partial
from typing import Any

import pytest
from faults import busy_on_second_reset, stuck_at_5, stuck_at_5_telling, wait_for_fifo
from pipelines import (
    credit_outstanding,
    credit_window_of,
    gone,
    megabyte,
    pipeline,
    rs,
    snapshot_when,
    take,
    tiny,
    worker_processes,
)
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, subtest
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot import BatchingOptions, WorkerTimeoutError

ONE_PER_MESSAGE = BatchingOptions(max_items=1)
LARGE_BATCHES = BatchingOptions(max_items=64, max_delay_s=10.0)


def settled_lead(dl: Any, at_least: int) -> int:
    """How far the worker is ahead of the user, once it is at least ``at_least`` ahead (bounded
    wait): its credit stops it there."""
    (s,) = snapshot_when(dl, lambda snaps: snaps[0].produced - snaps[0].handed_on >= at_least)
    return s.produced - s.handed_on


class TestTransport(SuiteTestCase):
    def test_batching_changes_the_messages_not_the_data(self) -> None:
        reference = [list(self.make_dl(tiny(400), rs(2, batching=ONE_PER_MESSAGE)))]
        dl = self.make_dl(tiny(400), rs(2, batching=LARGE_BATCHES, worker_prefetch_cnt=100))
        it = iter(dl)
        head = take(it, 100)
        for s in dl.reading_service.snapshot():
            assert s.produced == s.sent + s.buffered
        assert head + list(it) == reference[0]
        # Counted once everything was written: mid-stream, a worker's counters may lag one batch
        # behind (its outbox thread updates them after a write, once it holds the GIL again).
        for s in dl.reading_service.snapshot():
            assert s.produced == s.sent == s.received == 200 and s.buffered == 0
            assert s.sent / s.batches >= 8, f"items travel in batches, got {s.sent} in {s.batches} messages"

    def test_small_items_run_ahead_further_than_the_prefetch_counts(self) -> None:
        """Tiny items are produced faster than a credit grant travels: the window covers 256 KiB
        of them (at most 512), so the worker does not wait for a grant every ten items."""
        dl = self.make_dl(tiny(4000), rs(1))
        it = iter(dl)
        take(it, 300)
        assert settled_lead(dl, at_least=256) >= 256

    def test_items_holding_shared_memory_stay_within_the_prefetch_counts(self) -> None:
        """A tensor's pickle is a handle into shared memory: the prefetch counts bound that memory.
        (What the main process granted is read directly: the worker reaches it only in its time.)
        The usual path (the tensor pool's slots are bounded by the window too: test_tensor_pool_loader)."""
        dl = self.make_dl(
            IterableWrapper(range(400)).sharding_filter().map(megabyte), rs(1, tensor_pool=False)
        )
        it = iter(dl)
        take(it, 100)
        window = credit_window_of(dl)  # the prefetch counts: 10 + 10 + 1
        assert all(outstanding <= window for outstanding in credit_outstanding(dl))
        assert settled_lead(dl, at_least=window // 2) <= window

    def test_one_item_per_message_when_asked(self) -> None:
        dl = self.make_dl(tiny(40), rs(2, batching=ONE_PER_MESSAGE))
        it = iter(dl)
        take(it, 10)
        assert all(s.batches == s.sent for s in dl.reading_service.snapshot())

    @parametrize("batching", [subtest(ONE_PER_MESSAGE, name="one"), subtest(LARGE_BATCHES, name="large")])
    def test_pause_limit_and_snapshots_stay_exact_with_batching(self, batching: BatchingOptions) -> None:
        reference = list(self.make_dl(pipeline("dispatch", 60), rs(2)))
        dl = self.make_dl(pipeline("dispatch", 60), rs(2, batching=batching))
        it = iter(dl)
        it.limit(7)
        got = list(it)
        *workers, dispatcher = dl.reading_service.snapshot()
        assert sum(s.handed_on for s in workers) == 7
        assert dispatcher.sent_per_worker == tuple(w.received_from_dispatcher for w in workers)
        it.limit(None)
        it.resume()
        assert got + list(it) == reference

    def test_a_worker_stuck_on_an_item_is_reported_by_the_item_timeout(self) -> None:
        dl = self.make_dl(
            IterableWrapper(range(20)).sharding_filter().map(stuck_at_5),
            rs(2, timeout_s=1.0, control_timeout_s=2.0),
        )
        start = time.monotonic()
        got = []
        it = iter(dl)
        pids = [p.pid for p in worker_processes(dl)]
        with pytest.raises(
            WorkerTimeoutError,
            match=r"worker 1 did not send an item within 1\.0 s; it is alive \(pid \d+\) but stuck "
            r"\(raise timeout_s, in seconds",
        ):
            for x in it:
                got.append(x)
        assert got == [0, 1, 2, 3, 4], "every item before the stuck one arrives, in order"
        assert time.monotonic() - start < 30
        assert gone(pids), "shut down, stuck or not"

    def test_an_epoch_reset_that_computes_past_control_timeout_s_is_waited_for(self) -> None:
        # A control timeout bounds a stuck worker, not a slow one: the second epoch's reset
        # computes for 3 s, three times the bound, and the epoch starts.
        dl = self.make_dl(
            IterableWrapper(range(8)).sharding_filter(),
            rs(2, control_timeout_s=1.0, worker_reset_fn=busy_on_second_reset),
        )
        assert sorted(dl) == list(range(8))
        assert sorted(dl) == list(range(8))

    def test_shutting_down_workers_all_stuck_waits_once_not_once_per_worker(self) -> None:
        dl = self.make_dl(
            IterableWrapper([5] * 8).sharding_filter().map(stuck_at_5), rs(4, control_timeout_s=1.0)
        )
        iter(dl)  # every worker is now stuck on its first item, deaf to requests
        pids = [p.pid for p in worker_processes(dl)]
        start = time.monotonic()
        dl.shutdown()
        assert time.monotonic() - start < 3.0, "one 1 s wait for the four goodbyes, then kill"
        assert gone(pids)

    def test_a_worker_stuck_on_an_item_cannot_hang_a_snapshot(self) -> None:
        fifo = str(self.tmp_path / "entered")
        os.mkfifo(fifo)
        stuck = partial(stuck_at_5_telling, fifo)
        dl = self.make_dl(
            IterableWrapper(range(20)).sharding_filter().map(stuck), rs(2, control_timeout_s=1.0)
        )
        it = iter(dl)
        take(it, 4)
        assert wait_for_fifo(fifo, timeout_s=60), "worker 1 reaches item 5"  # or it answers the snapshot
        pids = [p.pid for p in worker_processes(dl)]
        start = time.monotonic()
        with pytest.raises(
            WorkerTimeoutError,
            match=r"worker 1 did not send GetStateResponse within 1\.0 s and used no CPU time; it is alive "
            r"\(pid \d+\) but stuck \(raise control_timeout_s, in seconds, if it needs longer\)",
        ):
            dl.reading_service.snapshot()
        assert time.monotonic() - start < 30
        assert gone(pids), "the timeout shut the service down"


instantiate_parametrized_tests(TestTransport)


if __name__ == "__main__":
    unittest.main()
