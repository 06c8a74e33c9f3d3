"""The checkpoint's outlet: main-process replay checked against running digests, the pipeline's
own global RNG states with ``num_workers=0``, reading ahead within one swap of them."""

from __future__ import annotations

import random
import unittest
from typing import Any, Iterator, List

import numpy
import pytest
import torch
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data import IterDataPipe
from torchdata.datapipes.iter import IterableWrapper

import torchdata_snapshot.checkpoint.outlet as outlet_module
from torchdata_snapshot._constants import READ_AHEAD_BYTES, READ_AHEAD_ITEMS
from torchdata_snapshot._errors import ReplayDivergenceError
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain, chain_hex
from torchdata_snapshot.checkpoint.outlet import ReplayingOutlet, data_bytes
from torchdata_snapshot.checkpoint.rng_states import IsolatedRNG


def digest_of(items: List[Any]) -> str:
    value = CHAIN_START
    for item in items:
        value = chain(value, item)
    return chain_hex(value)


def _draw(x: int) -> Any:
    return (x, random.random())


class DrawsWhenIterated(IterDataPipe):
    """Draws an offset from the global ``random`` as soon as an iterator is asked for."""

    def __iter__(self) -> Iterator[int]:
        offset = random.randrange(1000)
        return iter([offset, offset + 1])


def _fail_at_7(x: int) -> int:
    if x == 7:
        raise ValueError("bad item 7")
    return x


def _draw_everywhere_then_fail_at_2(x: int) -> int:
    random.random(), torch.rand(1), numpy.random.rand()
    if x == 2:
        raise ValueError("bad item 2")
    return x


def _wait_5ms(x: int) -> int:
    import time

    time.sleep(0.005)
    return x


def isolated(datapipe: Any, read_ahead: bool = False) -> ReplayingOutlet:
    outlet = ReplayingOutlet(datapipe)
    outlet.rng, outlet.read_ahead = IsolatedRNG(), read_ahead
    outlet.start_epoch(0)
    return outlet


def reading_ahead(datapipe: Any) -> ReplayingOutlet:
    return isolated(datapipe, read_ahead=True)


class FailAt7:
    """Fails at item 7, noting how many items the user had received then."""

    def __init__(self) -> None:
        self.outlet: Any = None
        self.user_had: List[int] = []

    def __call__(self, x: int) -> int:
        if x == 7:
            self.user_had.append(self.outlet.delivered)
            raise ValueError("bad item 7")
        return x


def _megabyte(x: int) -> Any:
    return torch.full((262144,), float(x))


def _normal(x: int) -> Any:
    return (x, float(numpy.random.normal()))  # an odd count: numpy caches the pair's second value


def normals(read_ahead: bool, **start: Any) -> ReplayingOutlet:
    """An isolated outlet over 600 items drawing from numpy's normal distribution, seeded."""
    outlet = ReplayingOutlet(IterableWrapper(range(600)).map(_normal))
    outlet.rng, outlet.read_ahead, outlet.verify = IsolatedRNG(), read_ahead, True
    with outlet.rng.active():
        numpy.random.seed(5)
    outlet.start_epoch(0, **start)
    return outlet


class TestReplayingOutlet(SuiteTestCase):
    def test_main_process_replay_drops_the_items_the_user_had(self) -> None:
        outlet = ReplayingOutlet(IterableWrapper(range(10)), verify=True)
        outlet.start_epoch(2, skip=4, skip_digest=digest_of([0, 1, 2, 3]))
        assert outlet.delivered == 4, "the position is the checkpoint's before the replay ran"
        assert outlet.digest == digest_of([0, 1, 2, 3])
        assert list(outlet) == [4, 5, 6, 7, 8, 9]
        assert outlet.delivered == 10 and outlet.digest == digest_of(list(range(10)))

    @parametrize("skip", [1, 3, 4])
    def test_a_diverging_main_process_replay_is_refused_at_any_position(self, skip: int) -> None:
        outlet = ReplayingOutlet(IterableWrapper(range(10)), verify=True)
        outlet.start_epoch(0, skip=skip, skip_digest=digest_of([*range(skip - 1), "something else"]))
        with pytest.raises(
            ReplayDivergenceError, match=rf"main process: items 1\.\.{skip} of epoch 0 replayed differently"
        ):
            next(iter(outlet))
        short = ReplayingOutlet(IterableWrapper(range(2)))
        short.start_epoch(0, skip=4)
        with pytest.raises(ReplayDivergenceError, match="ended after 2 items"):
            next(iter(short))

    def test_keeps_the_running_digest_of_every_delivered_item_in_replay_mode(self) -> None:
        outlet = ReplayingOutlet(IterableWrapper(range(5)), verify=True)
        outlet.start_epoch(0)
        it = iter(outlet)
        assert outlet.digest is None, "nothing delivered yet"
        for k in range(1, 6):
            next(it)
            assert outlet.digest == digest_of(list(range(k)))
        unverified = ReplayingOutlet(IterableWrapper(range(5)))
        unverified.start_epoch(0)
        next(iter(unverified))
        assert unverified.digest is None

    def test_steps_run_with_the_pipelines_own_global_rng(self) -> None:
        def run(user_draws: int) -> List[Any]:
            outlet = ReplayingOutlet(IterableWrapper(range(4)).map(_draw))
            outlet.rng = IsolatedRNG()
            with outlet.rng.active():
                random.seed(11)
            outlet.start_epoch(0)
            got = []
            for item in outlet:
                got.append(item)
                for _ in range(user_draws):
                    random.random()
            return got

        assert run(0) == run(3)

    def test_an_item_that_raises_gives_the_caller_its_own_global_rng_states_back(self) -> None:
        it = iter(isolated(IterableWrapper(range(5)).map(_draw_everywhere_then_fail_at_2)))
        assert [next(it), next(it)] == [0, 1]
        random.seed(3)
        torch.manual_seed(3)
        numpy.random.seed(3)
        with pytest.raises(ValueError, match="bad item 2"):
            next(it)
        torch_3 = torch.Generator().manual_seed(3)
        assert random.random() == random.Random(3).random()
        assert torch.equal(torch.rand(1), torch.rand(1, generator=torch_3))
        assert numpy.random.rand() == numpy.random.RandomState(3).rand()

    def test_the_epochs_iterator_is_created_with_the_pipelines_own_global_rng(self) -> None:
        def run(user_draws: int) -> List[int]:
            outlet = ReplayingOutlet(DrawsWhenIterated())
            outlet.rng = IsolatedRNG()
            with outlet.rng.active():
                random.seed(11)
            outlet.start_epoch(0)
            for _ in range(user_draws):
                random.random()
            return list(outlet)

        assert run(0) == run(3)

    def test_with_isolated_rngs_each_item_is_produced_when_the_user_asks_for_it(self) -> None:
        outlet = isolated(IterableWrapper(range(1000)).map(_draw))
        got = []
        for item in outlet:
            assert outlet.produced_ahead == 0 and outlet.delivered == item[0] + 1
            got.append(item)
        assert got == list(reading_ahead(IterableWrapper(range(1000)).map(_draw))), "the same data"
        assert outlet.finished

    def test_reading_ahead_items_are_produced_ahead_and_handed_out_one_by_one(self) -> None:
        outlet = reading_ahead(IterableWrapper(range(1000)).map(_draw))
        it = iter(outlet)
        first = next(it)
        assert outlet.delivered == 1 and 0 < outlet.produced_ahead <= READ_AHEAD_ITEMS - 1
        rest = list(it)
        assert [first, *rest] == list(isolated(IterableWrapper(range(1000)).map(_draw)))
        assert outlet.delivered == 1000 and outlet.finished and outlet.produced_ahead == 0

    @parametrize("read_ahead", [False, True])
    def test_an_error_happens_when_the_user_asks_for_its_item_unless_read_ahead(
        self, read_ahead: bool
    ) -> None:
        fail = FailAt7()
        fail.outlet = isolated(IterableWrapper(range(20)).map(fail), read_ahead)
        it = iter(fail.outlet)
        assert [next(it) for _ in range(7)] == list(range(7))
        with pytest.raises(ValueError, match="bad item 7"):
            next(it)
        assert fail.user_had == [0 if read_ahead else 7]

    def test_an_error_produced_ahead_reaches_the_user_after_the_items_before_it(self) -> None:
        it = iter(reading_ahead(IterableWrapper(range(20)).map(_fail_at_7)))
        assert [next(it) for _ in range(7)] == list(range(7))
        with pytest.raises(ValueError, match="bad item 7"):
            next(it)
        with pytest.raises(ValueError, match="bad item 7"):
            next(it)

    def test_slow_items_are_not_produced_far_ahead(self) -> None:
        """The read-ahead stops after ``READ_AHEAD_S`` (2 ms): a 5 ms item is produced on demand."""
        outlet = reading_ahead(IterableWrapper(range(5)).map(_wait_5ms))
        for _ in outlet:
            assert outlet.produced_ahead == 0
        assert outlet.delivered == 5

    def test_large_items_are_produced_ahead_only_as_far_as_read_ahead_bytes(self) -> None:
        """1 MB tensors cost microseconds to make: the time bound would let 256 of them (256 MB)
        wait in the main process; the byte bound keeps it to 16 MB (time is taken out of play)."""
        self.monkeypatch.setattr(outlet_module, "READ_AHEAD_S", 60.0)
        outlet = reading_ahead(IterableWrapper(range(300)).map(_megabyte))
        it = iter(outlet)
        next(it)
        assert outlet.produced_ahead == READ_AHEAD_BYTES // 2**20 - 1
        small = reading_ahead(IterableWrapper(range(300)))
        next(iter(small))
        assert small.produced_ahead == READ_AHEAD_ITEMS - 1, "small items: the count bound"

    def test_reading_ahead_never_changes_the_data(self) -> None:
        """Items produced ahead start with numpy's Gaussian cache cleared, as after a swap of their
        own; so the data do not depend on how many items a swap produced (up to 2 ms' worth)."""
        assert list(normals(read_ahead=True)) == list(normals(read_ahead=False))

    @parametrize("read_ahead", [False, True])
    def test_a_main_process_replay_draws_as_the_items_it_replays_did(self, read_ahead: bool) -> None:
        uninterrupted = list(normals(read_ahead=not read_ahead))  # (the modes give the same data)
        resumed = normals(read_ahead, skip=300, skip_digest=digest_of(uninterrupted[:300]))
        assert list(resumed) == uninterrupted[300:]

    @parametrize(
        "item, size",
        [
            (torch.zeros(10, dtype=torch.int64), 80),
            (numpy.zeros(10), 80),
            ((torch.zeros(4), 3, "abc"), 16 + 3),
            ({"image": torch.zeros(8, dtype=torch.uint8), "name": b"xy"}, 10),
            ([torch.zeros(2), [torch.zeros(100)]], 8),  # one level down only
            (7, 0),
            (torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), check_invariants=True), 0),  # nbytes raises
        ],
    )
    def test_data_bytes_counts_tensors_arrays_strings_and_bytes(self, item: Any, size: int) -> None:
        assert data_bytes(item) == size

    def test_without_isolation_nothing_is_produced_ahead(self) -> None:
        outlet = ReplayingOutlet(IterableWrapper(range(10)))
        outlet.read_ahead = True  # (it amortizes swaps: without isolated RNGs there are none)
        outlet.start_epoch(0)
        it = iter(outlet)
        next(it)
        assert outlet.produced_ahead == 0


instantiate_parametrized_tests(TestReplayingOutlet)


if __name__ == "__main__":
    unittest.main()
