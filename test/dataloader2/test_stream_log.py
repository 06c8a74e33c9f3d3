"""What a checkpoint keeps of a worker's stream in the main process (``StreamLog``): the
running digests, sharding positions, captured states and files opened, from the kept position on."""

from __future__ import annotations

import pickle
import unittest
from dataclasses import replace
from typing import Optional, Tuple

from torch.testing._internal.common_utils import TestCase

from torchdata_snapshot.checkpoint.format import WorkerPosition
from torchdata_snapshot.checkpoint.stream_log import StreamLog
from torchdata_snapshot.core.main.worker_record import WorkerRecord
from torchdata_snapshot.core.messages import ItemsResponse, StateMarkResponse
from torchdata_snapshot.core.transport.batches import QueuedItem, items_message
from torchdata_snapshot.core.transport.item_codec import ItemEncoder


def logged(position: Optional[WorkerPosition] = None) -> Tuple[WorkerRecord, StreamLog]:
    """A stream with a log, started at ``position`` (``None``: the epoch's beginning)."""
    log = StreamLog()
    stream = WorkerRecord(0, None, window=21, log=log)  # type: ignore[arg-type]
    stream.start(0 if position is None else position.delivered, position)
    return stream, log


def stream_after(*messages: ItemsResponse) -> Tuple[WorkerRecord, StreamLog]:
    stream, log = logged()
    for message in messages:
        assert stream.file(message, epoch=0)
    return stream, log


def ints(count: int) -> ItemsResponse:
    encoder = ItemEncoder()
    for i in range(count):
        encoder.add(i)
    return ItemsResponse(0, *encoder.take(), None)


def counted(*taken: int) -> ItemsResponse:
    """A message of ``len(taken)`` items with their sharding positions, as a worker sends it."""
    return items_message([QueuedItem(0, pickle.dumps(i), None, False, t) for i, t in enumerate(taken)])


class TestFilesOpenedAfterAState(TestCase):
    """The main process keeps what each item's production opened from the kept state on: a
    position names the files opened after the state it starts from, and nothing older."""

    @staticmethod
    def items(count: int, opened: Tuple[Tuple[int, bytes], ...] = ()) -> ItemsResponse:
        return replace(ints(count), opened=opened)

    @staticmethod
    def state(position: int) -> StateMarkResponse:
        return StateMarkResponse(0, position, b"state")

    def test_a_position_names_the_files_opened_after_its_state(self) -> None:
        stream, log = stream_after(
            self.items(4, ((0, b"a"), (2, b"c"))), self.state(3), self.items(4, ((1, b"f"),))
        )
        self.assertEqual(log.position(2).opened, (b"a",), "no state before 2: from the epoch's start")
        self.assertEqual(log.position(3).opened, (b"a", b"c"))
        self.assertEqual(log.position(5).opened, (), "the state at 3 names what came before it")
        self.assertEqual(log.position(6).opened, (b"f",))

    def test_pruning_drops_only_what_no_later_position_needs(self) -> None:
        stream, log = stream_after(
            self.items(4, ((0, b"a"), (2, b"c"))), self.state(3), self.items(4, ((1, b"f"),))
        )
        stream.prune(3)
        self.assertEqual(log.position(3).opened, (b"a", b"c"), "still restored from the epoch's start")
        stream.prune(4)
        self.assertEqual(log.position(6).opened, (b"f",))
        self.assertEqual([blob for _, blob in log._opened], [b"f"], "before the state at 3: dropped")

    def test_a_restored_stream_starts_with_the_files_its_position_named(self) -> None:
        stream, log = logged(WorkerPosition(5, state=(3, b"state", None), opened=(b"d",)))
        stream.file(self.items(2, ((1, b"g"),)), epoch=0)
        self.assertEqual(log.position(5).opened, (b"d",), "a checkpoint right after the restore")
        self.assertEqual(log.position(7).opened, (b"d", b"g"))


class TestStreamLog(TestCase):
    def test_items_carry_their_sharding_positions_into_the_users_positions(self) -> None:
        assert items_message([QueuedItem(0, pickle.dumps(1))]).taken is None, "not counted: nothing travels"
        stream, log = stream_after(counted(3, 3, 7), counted(9))
        assert [log.position(at).taken for at in range(5)] == [0, 3, 3, 7, 9]
        stream.prune(4)
        assert log.position(4).taken == 9, "pruning keeps what the user's position needs"
        position = WorkerPosition(4, None, None, 9)  # a restored position
        stream.start(position.delivered, position)
        assert stream.file(counted(12), epoch=0) and [log.position(at).taken for at in (4, 5)] == [9, 12]


if __name__ == "__main__":
    unittest.main()
