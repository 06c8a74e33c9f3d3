import multiprocessing as mp
import unittest
from unittest import TestCase

from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService
from torchdata.datapipes.iter import IterableWrapper

n_elements = 20
mp_ctx_parametrize = parametrize("ctx", mp.get_all_start_methods())


def _sharded():
    return IterableWrapper(range(n_elements)).sharding_filter()


def _dispatched():
    return IterableWrapper(range(n_elements)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)


class TestReadingServiceSnapshot(TestCase):
    r"""
    ``MultiProcessingReadingService.snapshot()``: one ``WorkerSnapshot`` per worker (and the
    dispatching process's), taken mid-epoch at one consistent point, without losing or
    repeating an item.
    """

    def _loader(self, datapipe, ctx=None, **options):
        rs = MultiProcessingReadingService(num_workers=2, multiprocessing_context=ctx, **options)
        dl = DataLoader2(datapipe, reading_service=rs)
        self.addCleanup(dl.shutdown)
        return dl, dl.reading_service  # DataLoader2 runs a copy of the reading service it is given

    @mp_ctx_parametrize
    @parametrize("main_prefetch_cnt", [0, 10])
    @parametrize("worker_prefetch_cnt", [0, 10])
    def test_snapshot_mid_epoch(self, ctx, main_prefetch_cnt, worker_prefetch_cnt) -> None:
        dl, rs = self._loader(
            _sharded(), ctx, main_prefetch_cnt=main_prefetch_cnt, worker_prefetch_cnt=worker_prefetch_cnt
        )
        it = iter(dl)
        head = [next(it) for _ in range(7)]
        snapshots = rs.snapshot()
        rest = list(it)
        self.assertEqual(sorted(head + rest), list(range(n_elements)), "every item once")
        self.assertEqual([(s.worker_id, s.role) for s in snapshots], [(0, "worker"), (1, "worker")])
        for s in snapshots:
            self.assertEqual(s.epoch, 0)
            self.assertFalse(s.paused)
            self.assertEqual(s.produced, s.sent + s.buffered)
            self.assertEqual(s.received, s.produced)
            self.assertEqual(s.received, s.handed_on + s.buffered_in_main)
        if main_prefetch_cnt == 0:
            self.assertEqual(sum(s.handed_on for s in snapshots), 7, "what reached the user")

    def test_snapshot_counts_the_epoch(self) -> None:
        dl, rs = self._loader(_sharded(), main_prefetch_cnt=0)
        self.assertEqual(sorted(dl), list(range(n_elements)))
        it = iter(dl)
        next(it)
        self.assertEqual({s.epoch for s in rs.snapshot()}, {1})
        self.assertEqual(sum(s.handed_on for s in rs.snapshot()), 1)

    def test_snapshot_keeps_a_pause(self) -> None:
        dl, rs = self._loader(_sharded())
        it = iter(dl)
        head = [next(it) for _ in range(5)]
        dl._pause()
        self.assertTrue(all(s.paused for s in rs.snapshot()))
        with self.assertRaises(StopIteration):  # as a paused DataLoader2 does
            next(it)
        dl._resume()
        self.assertEqual(sorted(head + list(it)), list(range(n_elements)))

    @mp_ctx_parametrize
    def test_snapshot_with_a_dispatching_process(self, ctx) -> None:
        dl, rs = self._loader(_dispatched(), ctx, main_prefetch_cnt=0)
        it = iter(dl)
        head = [next(it) for _ in range(6)]
        *workers, dispatcher = rs.snapshot()
        self.assertEqual([s.role for s in workers], ["worker", "worker"])
        self.assertEqual((dispatcher.worker_id, dispatcher.role), (-1, "dispatcher"))
        self.assertEqual(dispatcher.sent_per_worker, tuple(s.received_from_dispatcher for s in workers))
        self.assertEqual(dispatcher.sent, sum(dispatcher.sent_per_worker))
        self.assertGreaterEqual(dispatcher.sent, sum(s.sent for s in workers))
        self.assertEqual(sorted(head + list(it)), list(range(n_elements)))

    def test_snapshot_in_process(self) -> None:
        dl = DataLoader2(_sharded(), reading_service=MultiProcessingReadingService(num_workers=0))
        self.addCleanup(dl.shutdown)
        it = iter(dl)
        [next(it) for _ in range(3)]
        (snapshot,) = dl.reading_service.snapshot()
        self.assertEqual((snapshot.role, snapshot.epoch, snapshot.produced, snapshot.handed_on), ("in_process", 0, 3, 3))

    def test_snapshot_before_iterating_is_refused(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "create an iterator of the DataLoader2 first"):
            MultiProcessingReadingService(num_workers=2).snapshot()


instantiate_parametrized_tests(TestReadingServiceSnapshot)


if __name__ == "__main__":
    unittest.main()
