"""IsolatedRNG: an in-process pipeline and the training loop never see each other's draws."""

from __future__ import annotations

import random
import struct
import sys
import unittest
from pathlib import Path
from typing import Callable, List, Tuple

import numpy
import torch
from suite_case import SuiteTestCase
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils.worker import WorkerInfo, process_reset_fn
from torchdata.datapipes.iter import IterableWrapper

import torchdata_snapshot
from torchdata_snapshot.checkpoint.rng_states import (
    IsolatedRNG,
    pack_python_state,
    packed_global_rng_state,
    seed_global_rngs,
    set_global_rng_state,
    unpack_global_rng_state,
    unpack_python_state,
)
from torchdata_snapshot.core.worker import heap


def draw() -> Tuple[float, float, float]:
    return random.random(), float(torch.rand(())), float(numpy.random.rand())


def pipeline_draws(user_draws_between: int) -> List[Tuple[float, float, float]]:
    rng = IsolatedRNG()
    with rng.active():
        random.seed(1)
        torch.manual_seed(1)
        numpy.random.seed(1)
    out = []
    for _ in range(3):
        with rng.active():
            out.append(draw())
        for _ in range(user_draws_between):
            draw()  # the training loop: dropout, augmentation, ...
    return out


def odd_normals() -> Tuple[float, float, float]:
    """One value from each library's normal distribution: the second of numpy's pair is cached."""
    return random.gauss(0, 1), float(torch.randn(())), float(numpy.random.normal())


def seeded_rng() -> IsolatedRNG:
    rng = IsolatedRNG()
    with rng.active():
        random.seed(2)
        torch.manual_seed(2)
        numpy.random.seed(2)
    return rng


def _draw_everything() -> Tuple[float, float, float, float]:
    return (random.random(), random.gauss(0, 1), torch.rand(1).item(), float(numpy.random.standard_normal()))


class TestRng(SuiteTestCase):
    def test_the_pipeline_draws_the_same_whatever_the_caller_draws(self) -> None:
        assert pipeline_draws(0) == pipeline_draws(5)

    def test_the_caller_draws_the_same_whatever_the_pipeline_draws(self) -> None:
        random.seed(7)
        torch.manual_seed(7)
        numpy.random.seed(7)
        expected = [draw() for _ in range(3)]
        random.seed(7)
        torch.manual_seed(7)
        numpy.random.seed(7)
        rng = IsolatedRNG()
        got = []
        for _ in range(3):
            with rng.active():
                draw()
                draw()
            got.append(draw())
        assert got == expected

    def test_the_caller_state_comes_back_even_if_the_pipeline_raises(self) -> None:
        random.seed(3)
        before = random.getstate()
        rng = IsolatedRNG()
        try:
            with rng.active():
                random.random()
                raise ValueError("boom")
        except ValueError:
            pass
        assert random.getstate() == before

    def test_each_item_starts_with_an_empty_numpy_gaussian_cache_however_items_are_grouped(self) -> None:
        one_swap_per_item = seeded_rng()
        expected = []
        for _ in range(4):
            with one_swap_per_item.active():
                expected.append(odd_normals())
        grouped = seeded_rng()
        got = []
        with grouped.active():
            for i in range(4):
                if i:
                    grouped.next_item()
                got.append(odd_normals())
        assert got == expected
        numpy.random.seed(2)
        first, carried = numpy.random.normal(), numpy.random.normal()  # (the pair's second is cached)
        assert got[0][2] == first and got[1][2] != carried, "the second item drew a new pair"

    def test_the_caller_keeps_its_numpy_bit_generator_and_the_pipeline_has_its_own(self) -> None:
        callers = numpy.random.get_bit_generator()
        rng = seeded_rng()
        with rng.active():
            pipelines = numpy.random.get_bit_generator()
            numpy.random.rand()
        assert numpy.random.get_bit_generator() is callers and pipelines is not callers
        with rng.active():
            assert numpy.random.get_bit_generator() is pipelines

    def test_without_set_bit_generator_numpy_states_are_swapped_by_value_with_the_same_draws(self) -> None:
        """numpy < 1.25 has no set_bit_generator: get_state()/set_state(), the cache cleared alike."""

        def items(rng: IsolatedRNG) -> List[Tuple[float, float, float]]:
            out = []
            for _ in range(3):
                with rng.active():
                    out.append(odd_normals())
                numpy.random.normal()  # the caller's draws
            with rng.active():
                out.append(odd_normals())
                rng.next_item()
                out.append(odd_normals())
            return out

        by_reference = items(seeded_rng())
        self.monkeypatch.delattr(numpy.random, "set_bit_generator")
        assert items(seeded_rng()) == by_reference

    def test_numpy_random_imported_by_the_pipeline_gives_the_caller_a_state_of_its_own(self) -> None:
        rng = IsolatedRNG()
        module = sys.modules["numpy.random"]
        self.monkeypatch.delitem(sys.modules, "numpy.random")  # not imported yet when the block starts
        with rng.active():
            sys.modules["numpy.random"] = module  # the pipeline imports it
            numpy.random.seed(4)
        assert numpy.random.get_bit_generator() is not rng._numpy
        with rng.active():
            first = numpy.random.rand()
        numpy.random.rand()  # the caller's draw does not reach the pipeline's state
        with rng.active():
            second = numpy.random.rand()
        numpy.random.seed(4)
        assert [first, second] == list(numpy.random.rand(2))

    def test_a_packed_global_state_set_back_gives_the_same_draws(self) -> None:
        """Past the twister's 624 words and with both Gaussian caches full (an odd number of
        normals drawn), the packed state brings back exactly the draws that followed it."""
        random.seed(1)
        torch.manual_seed(1)
        numpy.random.seed(1)
        for _ in range(700):
            _draw_everything()
        numpy.random.standard_normal(3)
        random.gauss(0, 1)
        packed = packed_global_rng_state()
        expected = [_draw_everything() for _ in range(5)]
        set_global_rng_state(unpack_global_rng_state(packed))
        assert [_draw_everything() for _ in range(5)] == expected

    def test_packed_states_are_plain_little_endian_bytes_read_through_public_apis(self) -> None:
        """The words are stored little-endian whatever the machine, so a checkpoint moves between
        byte orders; they are what ``getstate()``/``get_state()`` return."""
        rng = random.Random(7)
        rng.random()
        version, words, gauss = pack_python_state(rng.getstate())
        assert words == struct.pack("<625I", *rng.getstate()[1])
        assert unpack_python_state((version, words, gauss)) == rng.getstate()
        numpy.random.seed(3)
        _, key, *_ = packed_global_rng_state()[2]
        assert key == numpy.random.get_state()[1].astype("<u4").tobytes()

    def test_the_global_rngs_are_seeded_as_a_workers_are_at_its_epochs_start(self) -> None:
        def draws_after(seed: Callable[[], None]) -> Tuple[float, float, float]:
            with IsolatedRNG().active():  # (the test's own global states are left alone)
                seed()
                return draw()

        ours = draws_after(lambda: seed_global_rngs(SeedGenerator(5)))
        workers = draws_after(
            lambda: process_reset_fn(IterableWrapper([]), WorkerInfo(1, 0), SeedGenerator(5))
        )
        assert ours == workers
        assert ours != draws_after(lambda: seed_global_rngs(SeedGenerator(6)))

    def test_the_package_reads_no_object_memory(self) -> None:
        """RNG states are read through their APIs, never at addresses of objects: the one module
        that uses ``ctypes`` calls a C function (``mallopt``), and reads no memory with it."""
        package = Path(torchdata_snapshot.__file__).parent
        users = [p for p in package.rglob("*.py") if "ctypes" in p.read_text()]
        assert users == [Path(heap.__file__)]
        reads = ("addressof", "from_address", "string_at", "memmove", "ctypes.cast", "POINTER", "c_void_p")
        assert [r for r in reads if r in users[0].read_text()] == []


if __name__ == "__main__":
    unittest.main()
