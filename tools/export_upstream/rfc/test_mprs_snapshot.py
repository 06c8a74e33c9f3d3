import multiprocessing as mp
import os
import unittest
from unittest import TestCase

import psutil
import torch

from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from torchdata.datapipes.map import SequenceWrapper

n_elements = 20
mp_ctx_parametrize = parametrize("ctx", mp.get_all_start_methods())


def _sharded():
    return IterableWrapper(range(n_elements)).sharding_filter()


def _dispatched():
    return IterableWrapper(range(n_elements)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)


def _double(x):
    return 2 * x


def _parity(x):
    return x % 2


def _zipped(first, second):
    return first.zip(second)


def _muxed(first, second):
    return first.mux(second)


def _kill(process):
    """Kill ``process`` and wait until it has exited, leaving it to be reaped by its parent: a
    worker started by this process is reaped by multiprocessing, which then sees it exited."""
    child = process.ppid() == os.getpid()
    process.kill()
    if child and hasattr(os, "waitid"):
        try:
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # multiprocessing has reaped it already (a thread waiting for it)
            pass
    else:
        process.wait(60)


class _OwnIterator(IterDataPipe):
    """A DataPipe of one's own whose iterator is not a generator, with a state of its own."""

    def __init__(self, source_datapipe):
        self.source_datapipe = source_datapipe

    def __iter__(self):
        return iter(list(self.source_datapipe))

    def state_dict(self):
        return {"own": True}


#: The graphs MultiProcessingReadingService runs, by name: each yields ``n_elements`` items.
GRAPHS = {
    "map_style_source": lambda: SequenceWrapper(range(n_elements)).to_iter_datapipe().sharding_filter(),
    "map_style_map": lambda: SequenceWrapper(range(n_elements)).map(_double).to_iter_datapipe().sharding_filter(),
    "fork_zip": lambda: _zipped(*_sharded().fork(2)),
    "demux_mux": lambda: _muxed(*IterableWrapper(range(n_elements)).demux(2, _parity)).sharding_filter(),
    "dispatch": lambda: _dispatched().shuffle().map(_double),
    "shuffle_batch_unbatch": lambda: IterableWrapper(range(n_elements)).shuffle().sharding_filter().batch(3).unbatch(),
    "batch_collate": lambda: IterableWrapper(range(n_elements)).sharding_filter().batch(1).collate(),
    "own_datapipes": lambda: _OwnIterator(_OwnIterator(_sharded())),
}


def _graph(name):
    """Module-level, so that a spawned worker unpickles the graph's functions by name."""
    return GRAPHS[name]()


def _canonical(item):
    """An item as a sortable value (a collated batch is a tensor, a zipped item a tuple)."""
    return repr(item.tolist() if isinstance(item, torch.Tensor) else item)


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

    @parametrize("graph", sorted(GRAPHS))
    @parametrize("ctx, prefetch_cnt", [(None, 0), (None, 10), ("spawn", 10), ("forkserver", 10)])
    def test_snapshot_on_the_graphs_the_reading_service_runs(self, graph, ctx, prefetch_cnt) -> None:
        if ctx is not None and ctx not in mp.get_all_start_methods():
            self.skipTest(f"{ctx} is not a start method of this platform")
        expected = sorted(_canonical(item) for item in _graph(graph))
        dl, rs = self._loader(
            _graph(graph), ctx, main_prefetch_cnt=prefetch_cnt, worker_prefetch_cnt=prefetch_cnt
        )
        it = iter(dl)
        head = [next(it) for _ in range(5)]
        snapshots = rs.snapshot()
        rest = list(it)
        self.assertEqual(sorted(_canonical(item) for item in head + rest), expected, "every item once")
        roles = ["worker", "worker"] + (["dispatcher"] if graph == "dispatch" else [])
        self.assertEqual([s.role for s in snapshots], roles)
        for s in snapshots[:2]:
            self.assertEqual(s.received, s.handed_on + s.buffered_in_main)
        if graph == "own_datapipes":
            for s in snapshots:
                own = [state for key, state in s.datapipe_states.items() if key.endswith(":_OwnIterator")]
                self.assertEqual(own, [{"own": True}] * 2)
        if graph.startswith("map_style"):  # a MapDataPipe keeps no count: absent
            self.assertFalse(any("MapDataPipe" in key for s in snapshots for key in s.datapipe_yields))

    @mp_ctx_parametrize
    def test_snapshot_raises_naming_a_worker_that_died(self, ctx) -> None:
        dl, rs = self._loader(_sharded(), ctx)
        it = iter(dl)
        [next(it) for _ in range(4)]
        _kill(psutil.Process(rs.snapshot()[0].pid))
        with self.assertRaisesRegex(RuntimeError, r"worker 0 \(pid \d+\) exited unexpectedly"):
            rs.snapshot()

    def test_snapshot_before_iterating_is_refused(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "create an iterator of the DataLoader2 first"):
            MultiProcessingReadingService(num_workers=2).snapshot()


instantiate_parametrized_tests(TestReadingServiceSnapshot)


if __name__ == "__main__":
    unittest.main()
