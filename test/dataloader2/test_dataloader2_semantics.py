"""What torchdata's own DataLoader2 tests expect of a MultiProcessingReadingService, in our words
(docs/migration.rst): the graph the reading service adapted, seeds that depend only on the
SeedGenerator handed over, breaking out early, pausing and limiting, and ``num_workers=0`` running
the pipeline when the user asks for an item, seeded as torchdata seeds it (restarting a saved
epoch and the pipeline's own RNG states: test_restore_semantics.py)."""

from __future__ import annotations

import random
import threading
import unittest
import warnings
from typing import Any, List, Tuple

import numpy
import pytest
import torch
from pipelines import NonReplicable, double, pipeline, rs, take, with_global_randomness
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2.reading_service import MultiProcessingReadingService as TorchdataMPRS
from torchdata.datapipes.iter import IterableWrapper


def reseed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


# --- the adapted graph --------------------------------------------------------------------------


def epoch_with_global_draws(dl: DataLoader2) -> List[Tuple[Any, ...]]:
    return [tuple(item) for item in dl]


def linger_prefetcher_threads(datapipe: Any, worker_info: Any) -> Any:
    """A ``worker_init_fn``: a Prefetcher thread whose source ended lingers 0.5 s, not 10 ms."""
    import torchdata.datapipes.iter.util.prefetcher as prefetcher

    prefetcher.PRODUCER_SLEEP_INTERVAL = 0.05
    return datapipe


CALLS = [0]  # calls of count_calls

CURRICULUM_LEVEL = 0  # set by the training loop before it asks for an item


def count_calls(x: int) -> int:
    CALLS[0] += 1
    return x


def at_curriculum_level(x: int) -> Tuple[int, int]:
    return x, CURRICULUM_LEVEL


class TestDataloader2Semantics(SuiteTestCase):
    @parametrize("num_workers", [0, 2])
    def test_the_end_datapipe_is_the_last_datapipe_of_the_adapted_graph(self, num_workers: int) -> None:
        dl = self.make_dl(NonReplicable(IterableWrapper(range(10)).sharding_filter()), rs(num_workers))
        it = iter(dl)
        assert type(dl.reading_service._end_datapipe) is NonReplicable, (
            "what DataLoader2's own reading service puts there"
        )
        assert sorted(list(it) + list(dl)) == sorted(2 * list(range(10)))

    @parametrize("num_workers", [1, 3])
    def test_reseeding_the_globals_before_an_epoch_gives_the_same_data_and_worker_draws(
        self, num_workers: int
    ) -> None:
        """Without dl.seed(), DataLoader2 seeds its generator from torch's global RNG at every iter():
        re-seeding the globals identically before two epochs must give the same items and the same
        draws from the workers' random/torch/numpy (no epoch counter mixed into the seeds)."""
        dl = self.make_dl(
            IterableWrapper(range(32)).shuffle().sharding_filter().map(with_global_randomness),
            rs(num_workers),
            seed=None,
        )
        epochs = []
        for seed in (123, 123, 321):
            reseed_globals(seed)
            epochs.append(epoch_with_global_draws(dl))
        assert epochs[0] == epochs[1], "same generator state: same data, same worker-local draws"
        assert [x[0] for x in epochs[0]] != [x[0] for x in epochs[2]], "another seed: another order"
        assert [x[1:] for x in epochs[0]] != [x[1:] for x in epochs[2]], "and other worker-local draws"

    def test_reseeding_the_globals_gives_the_same_data_with_a_dispatching_process(self) -> None:
        dispatched = (
            IterableWrapper(list(range(10)))
            .shuffle()
            .sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        )
        dl = self.make_dl(dispatched.map(double).shuffle(), rs(2), seed=None)
        epochs = []
        for seed in (123, 123, 321):
            reseed_globals(seed)
            epochs.append(list(dl))
        assert sorted(epochs[0]) == [2 * x for x in range(10)]
        assert epochs[0] == epochs[1] and epochs[0] != epochs[2]

    def test_a_seeded_loader_still_reshuffles_every_epoch_and_repeats_across_loaders(self) -> None:
        def epochs() -> List[List[Any]]:
            dl = self.make_dl(pipeline("shuffle_before_sharding", 40), rs(2), seed=7)
            return [list(dl) for _ in range(3)]

        first, again = epochs(), epochs()
        assert first == again
        assert first[0] != first[1] != first[2]

    @parametrize("worker_prefetch_cnt", [0, 10])
    @parametrize("main_prefetch_cnt", [0, 10])
    @parametrize("shape", ["shuffle_before_sharding", "dispatch"])
    def test_shutting_down_after_a_few_items_is_clean(
        self, shape: str, main_prefetch_cnt: int, worker_prefetch_cnt: int
    ) -> None:
        for _ in range(3):  # test_mprs.py's version of this test is flaky (pytorch/data#1310); ours is not
            dl = DataLoader2(
                pipeline(shape, 1000),
                reading_service=rs(
                    2, main_prefetch_cnt=main_prefetch_cnt, worker_prefetch_cnt=worker_prefetch_cnt
                ),
            )
            it = iter(dl)
            assert len(take(it, 10)) == 10
            dl.shutdown()

    def test_pausing_a_prefetcher_whose_source_just_ended_returns(self) -> None:
        """``Prefetcher.pause()`` waits for its thread to report that it paused; a thread
        whose source ended reports once, lingers (10 ms; 2 s here) and exits: a pause right after a
        resume in that window waited forever. Ours returns."""
        import time

        import torchdata.datapipes.iter.util.prefetcher as prefetcher

        from torchdata_snapshot.core.graph import pause_datapipe

        self.monkeypatch.setattr(prefetcher, "PRODUCER_SLEEP_INTERVAL", 0.2)  # the thread lingers 2 s
        dp = IterableWrapper(range(10)).prefetch()
        it = iter(dp)
        assert next(it) == 0
        deadline = time.monotonic() + 10
        while not dp.prefetch_data.stop_iteration and time.monotonic() < deadline:
            dp.thread.join(0.001)  # the thread reads all 10 items into its buffer, then its source ends
        assert dp.prefetch_data.stop_iteration and dp.thread.is_alive(), "in the window"
        pause_datapipe(dp)
        dp.resume()  # clears the thread's report; the thread will not report again
        pausing = threading.Thread(target=pause_datapipe, args=(dp,), daemon=True)
        pausing.start()
        pausing.join(5)
        assert not pausing.is_alive(), "the pause returned"
        dp.resume()
        assert list(it) == list(range(1, 10)), "and the data is all there"

    @parametrize("num_workers", [1, 2])
    def test_limit_pause_resume_rounds_over_stacked_prefetchers_in_the_workers(
        self, num_workers: int
    ) -> None:
        """The second half of test_mprs.py's test_reading_service_limit: a few items per round over two
        prefetchers whose source ends at once, so that pauses follow resumes while the prefetchers'
        threads linger (made long here). Every pause is answered (a hang would time out)."""
        dp = IterableWrapper(range(10)).shuffle().sharding_filter().prefetch().prefetch()
        options = dict(worker_prefetch_cnt=0, main_prefetch_cnt=0, control_timeout_s=10)
        dl = self.make_dl(dp, rs(num_workers, worker_init_fn=linger_prefetcher_threads, **options))
        it = iter(dl)
        it.limit(3)
        got = list(it)
        it.limit(4)
        it.resume()
        got += list(it)
        it.resume()
        it.limit(2)
        got += list(it)
        assert len(got) == 9

    def test_num_workers_0_runs_the_map_once_for_each_item_the_user_asked_for(self) -> None:
        dl = self.make_dl(IterableWrapper(range(300)).map(count_calls), rs(0))
        CALLS[0] = 0
        it = iter(dl)
        assert CALLS[0] == 0, "iter() runs no item"
        assert next(it) == 0 and CALLS[0] == 1
        for k, item in enumerate(it, start=1):
            assert (item, CALLS[0]) == (k, k + 1)

    @parametrize("options", [{}, {"isolate_rng": False}, {"read_ahead": True}])
    def test_num_workers_0_yields_torchdatas_items_for_the_same_seed(self, options: Any) -> None:
        """Shuffles before and after the sharding filter, seeded as torchdata's reading service
        seeds them in this process: the same items, epoch after epoch."""

        def graph() -> Any:
            return IterableWrapper(range(50)).shuffle().sharding_filter().shuffle().batch(3)

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Please use `InProcessReadingService`")
            theirs = self.make_dl(graph(), TorchdataMPRS(num_workers=0))
        ours = self.make_dl(graph(), rs(0, **options))
        for dl in (theirs, ours):
            dl.seed(11)
        epochs = [list(theirs) for _ in range(3)]
        assert [list(ours) for _ in range(3)] == epochs and epochs[0] != epochs[1] != epochs[2]

    def test_num_workers_0_sees_what_the_training_loop_set_before_asking_for_the_item(self) -> None:
        global CURRICULUM_LEVEL
        dl = self.make_dl(IterableWrapper(range(300)).map(at_curriculum_level), rs(0))
        it = iter(dl)
        for k in range(300):
            CURRICULUM_LEVEL = k // 10  # the loop raises the level every 10 steps
            assert next(it) == (k, k // 10)

    @parametrize("read_ahead", ["yes", 1, None])
    def test_read_ahead_must_be_a_bool(self, read_ahead: Any) -> None:
        with pytest.raises(TypeError, match="read_ahead must be a bool"):
            rs(0, read_ahead=read_ahead)


instantiate_parametrized_tests(TestDataloader2Semantics)


if __name__ == "__main__":
    unittest.main()
