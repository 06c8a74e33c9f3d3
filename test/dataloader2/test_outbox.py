"""Outbox: the worker's writing thread keeps order, batches what accumulated, counts exactly, and
never waits without a bound."""

from __future__ import annotations

import threading
import time
import unittest
from typing import Any, List, Tuple

import pytest
from suite_case import SuiteTestCase

from torchdata_snapshot import BatchingOptions
from torchdata_snapshot._constants import LIVENESS_CHECK_INTERVAL_S
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.transport.batches import QueuedItem
from torchdata_snapshot.core.transport.channel import (
    Channel,
    ParentGone,
    ParentWatch,
    make_pipe_pair,
)
from torchdata_snapshot.core.transport.item_codec import ItemDecoder, ItemEncoder
from torchdata_snapshot.core.transport.outbox import Outbox


def payload(item: Any) -> bytes:
    return ItemEncoder().dumps(item)


def read_all(channel: Channel) -> List[Any]:
    out = []
    while channel.poll():
        out.append(channel.recv(timeout_s=1))
    return out


class Blocking:
    """Holds the outbox thread inside its first write until released: items queue up behind it."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.entered = threading.Event()
        self.release = threading.Event()

    def send(self, message: Any) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10)
        self.endpoint.send(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.endpoint, name)


class TestOutbox(SuiteTestCase):
    def outbox_pair(self, batching: BatchingOptions = BatchingOptions()) -> Tuple[Outbox, Channel]:
        """``(outbox, channel)``; the outbox's thread is stopped after the test."""
        channel, endpoint, _ = make_pipe_pair()
        outbox = Outbox(endpoint, batching, "worker 0")

        def stop() -> None:
            channel.close()  # a write blocked on a full pipe ends with the reader gone
            outbox.close(timeout_s=10)
            assert not outbox._thread.is_alive()

        self.addCleanup(stop)
        return outbox, channel

    def test_items_and_messages_are_written_in_the_order_they_were_queued(self) -> None:
        outbox, channel = self.outbox_pair()
        outbox.start_epoch(0)
        outbox.put(QueuedItem(0, payload("a")))
        outbox.put(m.PauseResponse())
        outbox.put(QueuedItem(0, payload("b")))
        outbox.put(QueuedItem(0, payload("c")))
        outbox.drain()
        written = read_all(channel)
        assert isinstance(written[0], m.ItemsResponse) and ItemDecoder.decode(1, written[0].payload) == ["a"]
        assert written[1] == m.PauseResponse()
        assert [x for r in written[2:] for x in ItemDecoder.decode(r.count, r.payload)] == ["b", "c"]

    def test_what_accumulated_during_a_write_goes_out_as_one_bounded_message(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        blocking = Blocking(endpoint)
        outbox = Outbox(blocking, BatchingOptions(max_items=4), "worker 0")  # type: ignore[arg-type]
        try:
            outbox.start_epoch(0)
            outbox.put(QueuedItem(0, payload(0)))
            assert blocking.entered.wait(10)
            for x in range(1, 10):
                outbox.put(QueuedItem(0, payload(x), digest=x))
            blocking.release.set()
            outbox.drain()
            counts = [r.count for r in read_all(channel)]
            assert counts == [1, 4, 4, 1], "one write in progress, then batches of at most max_items"
            assert outbox.counters() == (10, 4)
        finally:
            blocking.release.set()
            outbox.close(timeout_s=10)
            channel.close()

    def test_items_put_while_the_thread_writes_take_no_lock(self) -> None:
        """The producing loop hands over every item: while the thread is busy writing, a put
        appends without waiting for the lock the thread takes between writes."""
        channel, endpoint, _ = make_pipe_pair()
        blocking = Blocking(endpoint)
        outbox = Outbox(blocking, BatchingOptions(), "worker 0")  # type: ignore[arg-type]
        try:
            outbox.start_epoch(0)
            outbox.put(QueuedItem(0, payload(0)))
            assert blocking.entered.wait(10)
            with outbox._cond:  # (held here: a put that needs it waits)
                putter = threading.Thread(target=outbox.put, args=(QueuedItem(0, payload(1)),))
                putter.start()
                putter.join(10)
                assert not putter.is_alive(), "the put waited for the lock"
            blocking.release.set()
            outbox.drain()
            assert [x for r in read_all(channel) for x in ItemDecoder.decode(r.count, r.payload)] == [0, 1]
        finally:
            blocking.release.set()
            outbox.close(timeout_s=10)
            channel.close()

    def test_an_item_put_alone_wakes_the_waiting_thread_every_time(self) -> None:
        """One item at a time, each read before the next is put: the thread waits for every one
        of them and must be woken each time (a wake-up lost would leave an item unwritten)."""
        outbox, channel = self.outbox_pair()
        outbox.start_epoch(0)
        for x in range(2000):
            outbox.put(QueuedItem(0, payload(x)))
            response = channel.recv(timeout_s=10)
            assert isinstance(response, m.ItemsResponse), f"item {x} was not written"
            assert ItemDecoder.decode(1, response.payload) == [x]

    def test_a_batch_closes_once_it_holds_max_bytes(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        blocking = Blocking(endpoint)
        outbox = Outbox(blocking, BatchingOptions(max_items=64, max_bytes=250), "worker 0")  # type: ignore[arg-type]
        try:
            outbox.start_epoch(0)
            outbox.put(QueuedItem(0, b"x"))
            assert blocking.entered.wait(10)
            for _ in range(6):
                outbox.put(QueuedItem(0, bytes(100)))
            blocking.release.set()
            outbox.drain()
            assert [len(r.payload) for r in read_all(channel)] == [1, 300, 300]
        finally:
            blocking.release.set()
            outbox.close(timeout_s=10)
            channel.close()

    def test_running_digests_travel_with_their_items(self) -> None:
        from array import array

        outbox, channel = self.outbox_pair(BatchingOptions(max_items=2))
        outbox.start_epoch(0)
        for x in range(3):
            outbox.put(QueuedItem(0, payload(x), digest=100 + x))
        outbox.drain()
        assert [d for r in read_all(channel) for d in array("Q", r.digests)] == [100, 101, 102]

    def test_a_new_epoch_drops_unwritten_items_of_the_old_one_but_not_messages(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        blocking = Blocking(endpoint)
        outbox = Outbox(blocking, BatchingOptions(), "worker 0")  # type: ignore[arg-type]
        try:
            outbox.start_epoch(0)
            outbox.put(QueuedItem(0, payload("written")))
            assert blocking.entered.wait(10)
            outbox.put(QueuedItem(0, payload("dropped")))
            outbox.put(m.ResetEpochResponse(1))
            threading.Timer(0.05, blocking.release.set).start()  # start_epoch waits for the write
            outbox.start_epoch(1, sent=5)
            outbox.put(QueuedItem(1, payload("new")))
            outbox.drain()
            written = read_all(channel)
            assert [type(r).__name__ for r in written] == [
                "ItemsResponse",
                "ResetEpochResponse",
                "ItemsResponse",
            ]
            assert ItemDecoder.decode(1, written[-1].payload) == ["new"]
            assert outbox.counters() == (6, 1), "counted from the replayed position"
        finally:
            blocking.release.set()
            outbox.close(timeout_s=10)
            channel.close()

    def test_drain_does_not_wait_forever_for_a_training_process_that_is_gone(self) -> None:
        """A write blocks while nobody reads the pipe; once the parent is gone, drain gives up."""
        outbox, channel = self.outbox_pair()
        outbox.endpoint.parent = ParentWatch(-1)  # not our parent: as if it had died
        outbox.start_epoch(0)
        outbox.put(QueuedItem(0, bytes(4 << 20)))  # larger than any pipe buffer: the write blocks
        start = time.monotonic()
        with pytest.raises(ParentGone):
            outbox.drain()
        assert time.monotonic() - start < 3 * LIVENESS_CHECK_INTERVAL_S

    def test_close_writes_what_is_queued_then_stops_the_thread(self) -> None:
        outbox, channel = self.outbox_pair()
        outbox.start_epoch(0)
        for x in range(5):
            outbox.put(QueuedItem(0, payload(x)))
        outbox.close(timeout_s=10)
        assert not outbox._thread.is_alive()
        assert [x for r in read_all(channel) for x in ItemDecoder.decode(r.count, r.payload)] == list(
            range(5)
        )

    def test_once_the_reader_is_gone_every_put_says_so(self) -> None:
        outbox, channel = self.outbox_pair()
        outbox.start_epoch(0)
        channel.close()
        outbox.put(QueuedItem(0, payload(1)))  # the thread finds the pipe closed at this write
        outbox.drain()  # returns: nothing can be written any more
        with pytest.raises(ParentGone):
            outbox.put(QueuedItem(0, payload(2)))


if __name__ == "__main__":
    unittest.main()
