"""One worker's stream as the main process records it: what it received, buffered and handed on
always add up, where it ended is kept in order, and its credit window follows the largest items
of the epoch (what a checkpoint keeps of a stream: test_stream_log.py)."""

from __future__ import annotations

import unittest

from torch.testing._internal.common_utils import TestCase

from torchdata_snapshot._constants import SMALL_ITEMS_MAX_WINDOW
from torchdata_snapshot.core.main.worker_record import WorkerRecord
from torchdata_snapshot.core.messages import ItemsResponse, StopIterationResponse
from torchdata_snapshot.core.transport.batches import END
from torchdata_snapshot.core.transport.item_codec import ItemEncoder

BUDGET = 1 << 18


def stream_after(*messages: ItemsResponse) -> WorkerRecord:
    stream = WorkerRecord(0, None, window=21, small_items_bytes=BUDGET)  # type: ignore[arg-type]
    stream.start()
    stream.grant()  # the epoch's first credit, as the consumer grants it
    for message in messages:
        assert stream.file(message, epoch=0)
    return stream


def ints(count: int, shared: int = 0) -> ItemsResponse:
    encoder = ItemEncoder()
    for i in range(count):
        encoder.add(i)
    return ItemsResponse(0, *encoder.take(), None, shared)


def strings(count: int, size: int) -> ItemsResponse:
    encoder = ItemEncoder()
    for _ in range(count):
        encoder.add("x" * size)
    return ItemsResponse(0, *encoder.take(), None)


class TestStream(TestCase):
    def test_received_buffered_and_handed_on_always_add_up(self) -> None:
        stream = stream_after(ints(3))
        self.assertEqual((stream.received, stream.handed_on, stream.credit.granted), (3, 0, 21))
        self.assertEqual([stream.take(), stream.take()], [0, 1])
        self.assertTrue(stream.counts_add_up())
        self.assertEqual((stream.received, stream.handed_on), (3, 2))

    def test_the_end_of_a_stream_comes_after_its_items_and_stale_epochs_are_dropped(self) -> None:
        stream = stream_after(ints(2))
        self.assertTrue(stream.file(StopIterationResponse(0), epoch=0))
        self.assertTrue(stream.file(ints(5), epoch=1), "a data message of another epoch is dropped")
        self.assertEqual([stream.take(), stream.take()], [0, 1])
        self.assertFalse(stream.exhausted)
        self.assertIs(stream.take(), END)
        self.assertTrue(stream.exhausted and stream.counts_add_up())

    def test_a_control_answer_is_not_the_streams(self) -> None:
        from torchdata_snapshot.core.messages import PauseResponse

        self.assertFalse(stream_after().file(PauseResponse(), epoch=0))

    def test_a_stream_keeps_the_window_its_largest_items_allow_for_the_epoch(self) -> None:
        assert stream_after(ints(64)).credit.window == SMALL_ITEMS_MAX_WINDOW
        # 100 KB strings once: a later message of small items does not let 512 of them run ahead.
        assert stream_after(ints(64), strings(2, 100_000), ints(64)).credit.window == 21
        assert stream_after(ints(64), ints(8, shared=1), ints(64)).credit.window == 21
        # A new epoch (or a restored position) measures again.
        stream = stream_after(strings(2, 100_000))
        stream.start()
        assert stream.file(ints(64), epoch=0) and stream.credit.window == SMALL_ITEMS_MAX_WINDOW


if __name__ == "__main__":
    unittest.main()
