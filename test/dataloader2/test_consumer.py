"""WorkerConsumer: round-robin order, credit, exact counts, epochs — workers run as threads."""

import unittest
from typing import Any

import pytest
from running_consumer import Running, round_robin
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.datapipes.iter import IterableWrapper
from worker_driver import Counting

from torchdata_snapshot._errors import ReadingServiceClosedError
from torchdata_snapshot.core.main.consumer import credit_window


def _fail_at_3(x: int) -> int:
    if x == 3:
        raise ValueError(f"bad sample {x}")
    return x


class TestConsumer(SuiteTestCase):
    def running(self, *args: Any, **kwargs: Any) -> Running:
        """Running streams, closed after the test."""
        running = Running(*args, **kwargs)
        self.addCleanup(running.close)
        return running

    def test_credit_window_covers_both_prefetch_counts(self) -> None:
        assert credit_window(num_workers=4, worker_prefetch_cnt=0, main_prefetch_cnt=0) == 1
        assert credit_window(num_workers=4, worker_prefetch_cnt=10, main_prefetch_cnt=10) == 10 + 3 + 1
        assert credit_window(num_workers=1, worker_prefetch_cnt=1, main_prefetch_cnt=1) == 3

    @parametrize("window", [1, 2, 16])
    def test_items_come_round_robin_with_uneven_streams(self, window: int) -> None:  # type: ignore[no-untyped-def]
        streams = [list(range(0, 5)), list(range(100, 102)), list(range(200, 207))]
        r = self.running([IterableWrapper(s) for s in streams], window=window, max_items=2)
        assert list(r.start_epoch()) == round_robin(streams)

    def test_workers_without_items_end_at_once(self) -> None:
        r = self.running(
            [IterableWrapper([1]), IterableWrapper([]), IterableWrapper([]), IterableWrapper([2])]
        )
        assert list(r.start_epoch()) == [1, 2]

    @parametrize("k", [0, 1, 5, 12])
    def test_snapshot_counts_add_up(self, k: int) -> None:  # type: ignore[no-untyped-def]
        r = self.running([IterableWrapper(range(10)), IterableWrapper(range(10))], window=4, max_items=3)
        it = r.start_epoch()
        taken = [next(it) for _ in range(k)]
        snaps = r.consumer.request_snapshot()
        assert len(taken) == k
        assert sum(s.handed_on for s in snaps) == k
        for s in snaps:
            assert s.produced == s.sent + s.buffered
            assert s.produced == s.received, "every item produced before the answer has been read"
            assert s.received == s.handed_on + s.buffered_in_main
            assert s.produced <= s.handed_on + 4, "never more than the credit window ahead"

    def test_production_follows_credit(self) -> None:
        dps = [Counting(IterableWrapper(range(100))) for _ in range(2)]
        r = self.running(dps, window=2, max_items=1)
        it = r.start_epoch()
        for _ in range(6):
            next(it)
        # 3 items delivered per worker, window 2: each worker may produce exactly 5. It answers
        # a snapshot between batches, so ask until it caught up with its credit (bounded).
        for _ in range(200):
            if [s.produced for s in r.consumer.request_snapshot()] == [5, 5]:
                break
        assert [dp.pulled for dp in dps] == [5, 5]
        assert [s.produced for s in r.consumer.request_snapshot()] == [5, 5], "and not one more"

    def test_a_new_epoch_drops_everything_in_flight(self) -> None:
        r = self.running(
            [IterableWrapper(range(50)).shuffle(), IterableWrapper(range(50)).shuffle()], window=8
        )
        first = r.start_epoch(seed=3)
        head = [next(first) for _ in range(5)]
        second = list(r.start_epoch(seed=3))
        assert second[:5] == head and len(second) == 100
        with pytest.raises(RuntimeError, match="invalidated"):
            next(first)  # an iterator of an old epoch is over, as for every IterDataPipe

    def test_a_worker_exception_is_raised_at_its_place_in_the_order(self) -> None:
        r = self.running(
            [IterableWrapper(range(10)).map(_fail_at_3), IterableWrapper(range(100, 110))], window=16
        )
        it = r.start_epoch()
        got = []
        with pytest.raises(ValueError, match=r"(?s)Caught ValueError in worker process 0.*bad sample 3"):
            while True:
                got.append(next(it))
        assert got == [0, 100, 1, 101, 2, 102]

    def test_control_requests_collect_every_answer(self) -> None:
        r = self.running([IterableWrapper(range(6)), IterableWrapper(range(6))], window=2)
        it = r.start_epoch()
        next(it)
        r.consumer.request_pause()
        assert all(s.paused for s in r.consumer.request_snapshot())
        r.consumer.request_resume()
        assert len(list(it)) == 11

    def test_terminate_is_idempotent_and_closes(self) -> None:
        r = self.running([IterableWrapper(range(3))])
        r.start_epoch()
        r.consumer.request_terminate(timeout_s=10)
        r.consumer.request_terminate(timeout_s=10)
        with pytest.raises(ReadingServiceClosedError, match="shut down"):
            r.consumer.request_snapshot()

    def test_the_consumer_is_a_leaf_for_graph_traversal(self) -> None:
        from torchdata.dataloader2.graph import traverse_dps

        r = self.running([IterableWrapper(range(3))])
        graph = traverse_dps(r.consumer.map(int))
        ((_, (_, parents)),) = graph.items()
        ((_, (consumer, grand_parents)),) = parents.items()
        assert consumer is r.consumer and grand_parents == {}

    def test_every_item_handed_on_names_its_worker_for_the_users_position(self) -> None:
        from torchdata_snapshot.core.main.positions import UserPositions

        positions = UserPositions(2)
        r = self.running([IterableWrapper([1, 2, 3]), IterableWrapper([10])], positions=positions)
        it = r.start_epoch()
        assert [next(it) for _ in range(3)] == [1, 10, 2]
        for _ in range(3):  # the outlet delivers what was handed on, in order
            positions.deliver_one()
        assert positions.delivered == [2, 1] and positions.last_worker == 0 and positions.next_worker == 1


instantiate_parametrized_tests(TestConsumer)


if __name__ == "__main__":
    unittest.main()
