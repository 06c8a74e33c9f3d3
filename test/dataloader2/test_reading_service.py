"""MultiProcessingReadingService end to end: drop-in behaviour and the RFC's snapshot()."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import unittest
from functools import partial
from typing import Any, List, Optional

import numpy
import pytest
import torch
from conftest import START_METHODS, start_methods
from pipelines import (
    CountingWithState,
    NonReplicable,
    double,
    fail_at_7,
    gone,
    pipeline,
    rs,
    snapshot_when,
    take,
    tiny,
    worker_processes,
)
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, subtest
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2 import MultiProcessingReadingService as TorchdataMPRS
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from torchdata_snapshot import MultiProcessingReadingService, ReadingServiceClosedError, WorkerSnapshot
from torchdata_snapshot._errors import ReadingServiceError
from torchdata_snapshot.core.options import FaultOptions, RestoreOptions


def run_epochs(
    make_dl: Any, datapipe: Any, reading_service: Any, epochs: int = 2, seed: int = 0
) -> List[List[Any]]:
    dl = make_dl(datapipe, reading_service, seed)
    return [list(dl) for _ in range(epochs)]


def assert_consistent(snaps: List[WorkerSnapshot], num_workers: int, delivered: Optional[int] = None) -> None:
    """The invariants of WorkerSnapshot: counts add up inside each worker and with the main process."""
    assert [s.worker_id for s in snaps] == list(range(num_workers))
    assert len({s.pid for s in snaps}) == num_workers and os.getpid() not in {s.pid for s in snaps}
    for s in snaps:
        assert s.role == "worker"
        assert s.produced == s.sent + s.buffered
        assert s.produced == s.received
        assert s.received == s.handed_on + s.buffered_in_main
        assert not hasattr(s, "delivered"), "delivered means reached the user: the checkpoint's word"
    if delivered is not None:
        assert sum(s.handed_on for s in snaps) == delivered


# --- drop-in -------------------------------------------------------------------------------------


def _init_fn(datapipe: Any, worker_info: Any) -> Any:
    return datapipe.map(partial(_tag, f"init{worker_info.worker_id}"))


def _tag(tag: str, x: Any) -> Any:
    return (tag, x)


def _reset_fn(datapipe: Any, worker_info: Any, seed_generator: Any) -> Any:
    datapipe.fn = partial(_tag, f"w{worker_info.worker_id}:{seed_generator.generate_seed() % 1000}")
    return datapipe


def _pid_tag(x: Any) -> Any:
    return (x, os.getpid())


_FORKED_START = """
import sys, warnings
warnings.simplefilter("ignore")
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper
from {module} import MultiProcessingReadingService
assert "numpy" in sys.modules and "numpy.random" not in sys.modules
rs = MultiProcessingReadingService(2, multiprocessing_context=sys.argv[1])
dl = DataLoader2(IterableWrapper(range(6)).sharding_filter(), reading_service=rs)
assert sorted(dl) == list(range(6))
dl.shutdown()
print("numpy.random" in sys.modules)
"""

#: numpy 2 imports ``numpy.random`` on first use; numpy 1 with ``import numpy``, leaving nothing to
#: inherit or to spare.
NUMPY_RANDOM_IS_LAZY = int(numpy.__version__.split(".")[0]) >= 2


def assert_consistent_cut(snaps: List[WorkerSnapshot], num_workers: int, delivered: int) -> None:
    *workers, dispatcher = snaps
    assert_consistent(workers, num_workers, delivered)
    assert dispatcher.role == "dispatcher" and dispatcher.worker_id == -1
    assert dispatcher.produced == dispatcher.sent + dispatcher.buffered
    assert dispatcher.sent_per_worker == tuple(w.received_from_dispatcher for w in workers)


class TestReadingService(SuiteTestCase):
    def test_is_a_torchdata_reading_service_with_the_same_defaults(self) -> None:
        ours, theirs = MultiProcessingReadingService(), TorchdataMPRS(num_workers=1)
        assert isinstance(ours, TorchdataMPRS)
        for name in (
            "multiprocessing_context",
            "worker_prefetch_cnt",
            "main_prefetch_cnt",
            "worker_init_fn",
            "worker_reset_fn",
        ):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.num_workers == 0

    @parametrize(
        "kwargs, match",
        [
            ({"num_workers": -1}, "num_workers must be a non-negative int"),
            ({"num_workers": 1.5}, "num_workers must be a non-negative int"),
            ({"worker_prefetch_cnt": -2}, "worker_prefetch_cnt"),
            ({"main_prefetch_cnt": None}, "main_prefetch_cnt"),
            ({"multiprocessing_context": "threads"}, "multiprocessing_context must be one of"),
            ({"control_timeout_s": 0}, "control_timeout_s must be > 0"),
            ({"timeout_s": -1}, "timeout_s must be > 0 or None"),
            ({"stateful": "yes"}, "stateful must be None, True or False"),
            (
                {"max_items_between_captures": 0},
                "max_items_between_captures must be >= 1 \\(stateful=False turns state captures off",
            ),
            ({"restart_dead_workers": -1}, "restart_dead_workers must be a non-negative int"),
            ({"verify_replay": 1}, "verify_replay must be a bool"),
            ({"restore": RestoreOptions()}, "unexpected keyword argument 'restore'"),
            ({"faults": FaultOptions()}, "unexpected keyword argument 'faults'"),
        ],
    )
    def test_bad_arguments_are_refused_with_value_errors(self, kwargs: Any, match: str) -> None:
        with pytest.raises((ValueError, TypeError), match=match):
            MultiProcessingReadingService(**kwargs)

    def test_each_option_has_one_spelling_whose_value_the_service_keeps(self) -> None:
        """The restore and fault options are keywords of the constructor, nothing else."""
        service = MultiProcessingReadingService(
            2,
            verify_replay=False,
            max_items_between_captures=7,
            stateful=False,
            control_timeout_s=3.0,
            timeout_s=60.0,
        )
        assert service.restore_options == RestoreOptions(
            verify_replay=False, max_items_between_captures=7, stateful=False
        )
        assert service.fault_options == FaultOptions(3.0, 60.0)
        assert MultiProcessingReadingService(2).restore_options == RestoreOptions()

    @parametrize("num_workers", [0, 1, 2, 4])
    def test_every_item_once_per_epoch(self, num_workers: int) -> None:
        epochs = run_epochs(self.make_dl, tiny(40), rs(num_workers))
        for epoch in epochs:
            assert sorted(epoch) == [2 * i for i in range(40)]

    @parametrize("num_workers", [1, 2, 4])
    def test_round_robin_keeps_the_order_of_a_shuffle_before_sharding(self, num_workers: int) -> None:
        # Worker i holds positions i, i+N, ... of the shuffled stream; taking one item per worker
        # in turn rebuilds that stream, so the order does not depend on num_workers.
        in_process = run_epochs(self.make_dl, tiny(40), rs(0))
        assert run_epochs(self.make_dl, tiny(40), rs(num_workers)) == in_process

    def test_same_seed_same_epochs_and_epochs_differ(self) -> None:
        first = run_epochs(self.make_dl, pipeline("shuffle_after_sharding", 60), rs(2), epochs=3, seed=7)
        again = run_epochs(self.make_dl, pipeline("shuffle_after_sharding", 60), rs(2), epochs=3, seed=7)
        other = run_epochs(self.make_dl, pipeline("shuffle_after_sharding", 60), rs(2), epochs=3, seed=8)
        assert first == again
        assert first != other
        assert first[0] != first[1] != first[2], "a seeded loader reshuffles every epoch"

    def test_more_workers_than_items(self) -> None:
        # The queue-based loop raises "Can not request next item while we are still waiting response" here.
        assert sorted(
            run_epochs(self.make_dl, tiny(3), rs(4, worker_prefetch_cnt=0, main_prefetch_cnt=0))[1]
        ) == [
            0,
            2,
            4,
        ]

    def test_breaking_out_of_an_epoch_and_starting_a_new_one(self) -> None:
        # The queue-based loop can kill a worker and deadlock here, or raise "Can not expect any response
        # without submitted request".
        reference = run_epochs(self.make_dl, tiny(50), rs(2), epochs=3)
        dl = self.make_dl(tiny(50), rs(2))
        got = []
        for epoch in range(3):
            it = iter(dl)
            if epoch < 2:
                got.append(take(it, 5 + epoch))
            else:
                got.append(list(it))
        assert got == [reference[0][:5], reference[1][:6], reference[2]]

    def test_a_worker_exception_is_reraised_with_the_worker_traceback(self) -> None:
        dl = self.make_dl(IterableWrapper(range(20)).sharding_filter().map(fail_at_7), rs(2))
        got = []
        with pytest.raises(
            ValueError, match=r"(?s)Caught ValueError in worker process 1.*fail_at_7.*sample 7 is corrupt"
        ):
            for x in dl:
                got.append(x)
        assert got == [0, 1, 2, 3, 4, 5, 6]

    def test_worker_init_and_reset_functions(self) -> None:
        service = rs(2, worker_init_fn=_init_fn, worker_reset_fn=_reset_fn)
        first, second = run_epochs(self.make_dl, IterableWrapper(range(4)).sharding_filter(), service)
        assert [x[1] for x in first] == [0, 1, 2, 3]
        assert {x[0] for x in first[0::2]} == {first[0][0]} and first[0][0].startswith("w0:")
        assert first[1][0].startswith("w1:")
        assert first[0][0] != second[0][0], "the reset function runs every epoch with that epoch's seed"

    def test_non_replicable_datapipes_stay_in_the_main_process(self) -> None:
        dp = NonReplicable(IterableWrapper(range(10)).sharding_filter().map(_pid_tag)).map(_pid_tag)
        items = run_epochs(self.make_dl, dp, rs(2), epochs=1)[0]
        assert [x[0][0] for x in items] == list(range(10))
        assert {x[1] for x in items} == {os.getpid()}
        assert len({x[0][1] for x in items}) == 2 and os.getpid() not in {x[0][1] for x in items}

    def test_pause_resume_and_limit(self) -> None:
        reference = run_epochs(self.make_dl, tiny(30), rs(2), epochs=1)[0]
        dl = self.make_dl(tiny(30), rs(2))
        it = iter(dl)
        it.limit(4)
        got = list(it)
        assert got == reference[:4], "limit pauses after 4 items"
        it.resume()
        got += take(it, 4)
        it.limit(None)
        dl._pause()
        dl._resume()
        got += list(it)
        assert got == reference

    def test_num_workers_0_runs_in_process(self) -> None:
        items = run_epochs(self.make_dl, IterableWrapper(range(6)).map(_pid_tag), rs(0), epochs=1)[0]
        assert items == [(i, os.getpid()) for i in range(6)]

    @parametrize(
        "call",
        [
            subtest(
                lambda service: service.initialize_iteration(SeedGenerator(0)), name="initialize_iteration"
            ),
            subtest(lambda service: service._pause(), name="pause"),
            subtest(lambda service: service._resume(), name="resume"),
            subtest(lambda service: service._limit(3, lambda datapipe, n: datapipe), name="limit"),
        ],
    )
    def test_calls_before_initialize_raise_a_reading_service_error_not_an_assertion(self, call: Any) -> None:
        """DataLoader2 calls these only after initialize(); a direct caller gets a typed error (an
        ``assert`` would vanish under ``python -O``)."""
        with pytest.raises(ReadingServiceError, match="needs a running reading service"):
            call(MultiProcessingReadingService(2))

    @parametrize("num_workers", [0, 1, 2])
    @parametrize("position", ["after the first item", "mid-epoch", "after the epoch's end"])
    def test_an_iterator_of_a_shut_down_loader_raises_instead_of_yielding(
        self, num_workers: int, position: str
    ) -> None:
        """After ``DataLoader2.shutdown()`` its iterator yields no item (num_workers=0 would go on
        running the graph in this process) and ends no epoch: it raises, naming the shutdown. (Before
        its first item, DataLoader2 itself drops the iterator's source at shutdown: ``TypeError``.)"""
        dl = self.make_dl(tiny(10), rs(num_workers))
        iterator = iter(dl)
        if position == "after the first item":
            next(iterator)
        elif position == "mid-epoch":
            assert len({next(iterator) for _ in range(3)}) == 3
        elif position == "after the epoch's end":
            assert sorted(iterator) == [double(x) for x in range(10)]
        dl.shutdown()
        for _ in range(2):  # and again: no later call yields either
            with pytest.raises(ReadingServiceClosedError, match=r"shut down \(DataLoader2.shutdown\(\)"):
                next(iterator)

    def test_snapshot_is_refused_before_the_service_runs_and_after_shutdown(self) -> None:
        dl = self.make_dl(tiny(10), rs(2))
        with pytest.raises(ReadingServiceError, match="create an iterator"):
            dl.reading_service.snapshot()
        next(iter(dl))
        assert len(dl.reading_service.snapshot()) == 2
        dl.shutdown()
        with pytest.raises(ReadingServiceClosedError, match="shut down"):
            dl.reading_service.snapshot()

    @parametrize("num_workers", [1, 2, 4])
    @parametrize("position", ["first", "one", "middle", "last", "exhausted"])
    def test_snapshot_at_every_position_of_an_epoch(self, num_workers: int, position: str) -> None:
        n = 30
        dl = self.make_dl(tiny(n), rs(num_workers))
        it = iter(dl)
        k = {"first": 0, "one": 1, "middle": n // 2, "last": n, "exhausted": n}[position]
        take(it, k)
        if position == "exhausted":
            assert list(it) == []
        snaps = dl.reading_service.snapshot()
        assert_consistent(snaps, num_workers, delivered=k)
        assert {s.epoch for s in snaps} == {0}
        if position == "exhausted":
            assert all(s.exhausted for s in snaps) and sum(s.produced for s in snaps) == n

    @parametrize("worker_prefetch_cnt", [0, 1, 10])
    @parametrize("main_prefetch_cnt", [0, 1, 10])
    def test_snapshots_never_perturb_the_data(self, worker_prefetch_cnt: int, main_prefetch_cnt: int) -> None:
        config = dict(worker_prefetch_cnt=worker_prefetch_cnt, main_prefetch_cnt=main_prefetch_cnt)
        reference = run_epochs(self.make_dl, pipeline("shuffle_after_sharding", 24), rs(2, **config))
        dl = self.make_dl(pipeline("shuffle_after_sharding", 24), rs(2, **config))
        observed = []
        for _ in range(2):
            epoch = []
            for k, item in enumerate(dl):
                assert_consistent(dl.reading_service.snapshot(), 2, delivered=k + 1)
                epoch.append(item)
            observed.append(epoch)
        assert observed == reference

    @parametrize("context", start_methods("spawn", "forkserver"))
    def test_snapshot_with_other_start_methods(self, context: str) -> None:
        reference = run_epochs(self.make_dl, tiny(20), rs(2), epochs=1)[0]
        dl = self.make_dl(tiny(20), rs(2, multiprocessing_context=context))
        it = iter(dl)
        got = take(it, 7)
        assert_consistent(dl.reading_service.snapshot(), 2, delivered=7)
        assert got + list(it) == reference

    @pytest.mark.skipif(not NUMPY_RANDOM_IS_LAZY, reason="numpy < 2 imports numpy.random with numpy")
    @parametrize(
        "context, imported", [(c, i) for c, i in [("fork", "True"), ("spawn", "False")] if c in START_METHODS]
    )
    def test_forked_workers_inherit_numpy_random_instead_of_importing_it(
        self, context: str, imported: str
    ) -> None:
        """A worker's first epoch reset seeds numpy's global RNG, which imports ``numpy.random`` (10
        of its 13 ms, at every start and restore) unless the parent did before forking; under spawn
        the parent is left alone."""
        start = _FORKED_START.format(module=MultiProcessingReadingService.__module__)
        body = "".join(f"    {line}\n" for line in start.strip().splitlines())
        script = f"if __name__ == '__main__':\n{body}"
        done = subprocess.run(
            [sys.executable, "-c", script, context], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == imported

    def test_snapshot_a_hundred_times_in_a_row(self) -> None:
        dl = self.make_dl(tiny(20), rs(2))
        it = iter(dl)
        take(it, 3)
        # The workers have the credit for all their 10 items: once they produced them, nothing moves.
        snapshot_when(dl, lambda snaps: all(s.exhausted for s in snaps))
        snaps = [dl.reading_service.snapshot() for _ in range(100)]
        assert all(s == snaps[0] for s in snaps), "nothing moves between back-to-back snapshots"
        assert_consistent(snaps[-1], 2, delivered=3)

    def test_snapshot_while_paused_by_limit(self) -> None:
        reference = run_epochs(self.make_dl, tiny(20), rs(2), epochs=1)[0]
        dl = self.make_dl(tiny(20), rs(2))
        it = iter(dl)
        it.limit(5)
        got = list(it)
        snaps = dl.reading_service.snapshot()
        assert all(s.paused for s in snaps)
        assert_consistent(snaps, 2, delivered=5)
        it.limit(None)
        it.resume()
        assert got + list(it) == reference

    def test_snapshot_reports_datapipe_yields_and_states(self) -> None:
        dl = self.make_dl(CountingWithState(IterableWrapper(range(8))).sharding_filter().map(double), rs(2))
        it = iter(dl)
        take(it, 3)
        snaps = dl.reading_service.snapshot()
        for s in snaps:
            assert s.datapipe_yields["0:MapperIterDataPipe"] == s.produced
            assert s.datapipe_states == {
                "2:CountingWithState": {"seen": s.datapipe_yields["2:CountingWithState"]}
            }

    @parametrize("read_ahead", [False, True])
    def test_snapshot_with_num_workers_0(self, read_ahead: bool) -> None:
        dl = self.make_dl(tiny(10), rs(0, read_ahead=read_ahead))
        it = iter(dl)
        take(it, 4)
        (snap,) = dl.reading_service.snapshot()
        assert (snap.role, snap.worker_id, snap.pid, snap.epoch) == ("in_process", 0, os.getpid(), 0)
        # Reading ahead, items are produced in one swap of the isolated RNG states (up to all ten).
        assert snap.handed_on == 4 and snap.produced == snap.handed_on + snap.buffered_in_main
        if not read_ahead:
            assert snap.produced == 4, "each item when the user asked for it"
        assert snap.datapipe_yields["1:MapperIterDataPipe"] == snap.produced

    def test_the_snapshot_is_picklable(self) -> None:
        import pickle

        dl = self.make_dl(tiny(10), rs(2))
        next(iter(dl))
        snaps = dl.reading_service.snapshot()
        assert pickle.loads(pickle.dumps(snaps)) == snaps

    def test_loader_in_a_with_block_shuts_down_its_workers(self) -> None:
        with DataLoader2(tiny(10), reading_service=rs(2)) as dl:
            next(iter(dl))
            processes = worker_processes(dl)
            assert all(p.is_alive() for p in processes)
            pids = [p.pid for p in processes]
        assert gone(pids)

    @parametrize("num_workers", [1, 2, 4])
    def test_dispatching_process_deals_every_item_once(self, num_workers: int) -> None:
        first, second = run_epochs(self.make_dl, pipeline("dispatch", 30), rs(num_workers))
        assert sorted(x[0] for x in first) == list(range(30)) == sorted(x[0] for x in second)
        assert first != second
        assert run_epochs(self.make_dl, pipeline("dispatch", 30), rs(num_workers)) == [first, second]

    @parametrize("context", start_methods("fork", "spawn"))
    def test_snapshot_with_a_dispatching_process_is_a_consistent_cut(self, context: str) -> None:
        reference = run_epochs(self.make_dl, pipeline("dispatch", 24), rs(2), epochs=1)[0]
        dl = self.make_dl(pipeline("dispatch", 24), rs(2, multiprocessing_context=context))
        got = []
        for k, item in enumerate(dl):
            assert_consistent_cut(dl.reading_service.snapshot(), 2, delivered=k + 1)
            got.append(item)
        assert got == reference
        assert_consistent_cut(dl.reading_service.snapshot(), 2, delivered=24)

    def test_pause_and_limit_with_a_dispatching_process(self) -> None:
        reference = run_epochs(self.make_dl, pipeline("dispatch", 20), rs(2), epochs=1)[0]
        dl = self.make_dl(pipeline("dispatch", 20), rs(2))
        it = iter(dl)
        it.limit(3)
        got = list(it)
        snaps = dl.reading_service.snapshot()
        assert all(s.paused for s in snaps)
        assert_consistent_cut(snaps, 2, delivered=3)
        it.limit(None)
        it.resume()
        assert got + list(it) == reference

    @parametrize("shape", ["shuffle_before_sharding", "dispatch"])
    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    def test_workers_outlive_idle_periods_longer_than_every_liveness_interval(
        self, context: str, shape: str
    ) -> None:
        """A worker that receives no request for a while checks that the training process still
        exists; under forkserver its parent is the fork server, not the training process."""
        from torchdata_snapshot._constants import LIVENESS_CHECK_INTERVAL_S

        idle_s = 2.5 * LIVENESS_CHECK_INTERVAL_S  # the slow training step of this test
        reference = list(self.make_dl(pipeline(shape, 60), rs(2)))
        dl = self.make_dl(pipeline(shape, 60), rs(2, multiprocessing_context=context))
        it = iter(dl)
        time.sleep(idle_s)  # between iter() and the first item
        got = take(it, 3)
        time.sleep(idle_s)  # a slow step in the middle of the epoch
        assert got + list(it) == reference

    def test_a_graph_with_two_replicable_branches_is_refused_before_any_process_starts(self) -> None:
        from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

        dispatched = IterableWrapper(range(10)).sharding_round_robin_dispatch(
            SHARDING_PRIORITIES.MULTIPROCESSING
        )
        two_branches = NonReplicable(dispatched).zip(IterableWrapper(range(10)).sharding_filter())
        dl = self.make_dl(two_branches, rs(2))
        children = set(multiprocessing.active_children())
        with pytest.raises(ValueError, match="needs exactly one replicable branch"):
            iter(dl)
        assert set(multiprocessing.active_children()) == children, "refused before any process started"

    def test_no_epoch_start_pickles_the_tensors_a_worker_graph_holds(self) -> None:
        # After a worker's graph is sharded (torch's apply_sharding pickles it once, as the
        # queue-based loop's workers do), its preparation and every epoch's reset traverse it
        # without pickling the data it holds (examples/dataloader2/train_loop_reading_service.py:
        # ~1.8 s a traversal).
        data = [torch.full((2,), float(i)) for i in range(40)]
        dl = self.make_dl(
            IterableWrapper(data).shuffle().sharding_filter(), rs(2, worker_init_fn=refuse_to_pickle_tensors)
        )
        for epoch in range(3):
            dl.seed(epoch)
            assert sorted(int(t[0]) for t in dl) == list(range(40)), f"epoch {epoch}"


def refuse_to_pickle_tensors(datapipe: IterDataPipe, info: Any) -> IterDataPipe:
    """``worker_init_fn``: from here on, a tensor pickled while a graph is traversed (the
    traversal's getstate hook is set then) fails the worker."""
    reduce_ex = torch.Tensor.__reduce_ex__

    def refuse(self: torch.Tensor, protocol: int) -> Any:
        if IterDataPipe.getstate_hook is not None:
            raise AssertionError("a tensor of the graph was pickled to traverse it")
        return reduce_ex(self, protocol)

    torch.Tensor.__reduce_ex__ = refuse  # type: ignore[method-assign]
    return datapipe


instantiate_parametrized_tests(TestReadingService)


if __name__ == "__main__":
    unittest.main()
