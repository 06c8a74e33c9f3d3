"""RNG states read from memory are the states the RNGs' own APIs return, in every case the API has
(cached Gaussians, regenerated words, states set by hand), and a layout that is not recognised
falls back on the API."""

from __future__ import annotations

import random
from typing import Any, Callable, Tuple

import numpy
import pytest
import torch

from torchdata_snapshot import _rng_memory
from torchdata_snapshot._rng import (
    pack_python_state,
    packed_global_rng_state,
    set_global_rng_state,
    unpack_global_rng_state,
    unpack_numpy_state,
)
from torchdata_snapshot._rng_memory import NumpyStateReader, packed_random_state

PYTHON_STEPS: Tuple[Callable[[random.Random], Any], ...] = (
    lambda rng: None,
    lambda rng: rng.random(),
    lambda rng: [rng.random() for _ in range(700)],  # past the 624 words: they are regenerated
    lambda rng: rng.gauss(0, 1),  # leaves gauss_next set
    lambda rng: rng.seed(12),
    lambda rng: rng.setstate((3, tuple(range(3, 627)) + (17,), 0.25)),
)


@pytest.mark.parametrize("step", range(len(PYTHON_STEPS)))
def test_a_random_generator_reads_as_its_getstate(step: int) -> None:
    rng = random.Random(5)
    PYTHON_STEPS[step](rng)
    assert _rng_memory._INDEX_AT is not None, "this CPython's layout is recognised"
    assert packed_random_state(rng) == pack_python_state(rng.getstate())


def test_a_subclass_with_its_own_getstate_is_read_through_it() -> None:
    class Shifted(random.Random):
        def getstate(self) -> Any:
            version, words, gauss = super().getstate()
            return version, words, 0.5

    assert packed_random_state(Shifted(1))[2] == 0.5


def test_an_unrecognised_python_layout_falls_back_on_getstate(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(8)
    rng.gauss(0, 1)
    monkeypatch.setattr(_rng_memory, "_INDEX_AT", None)
    assert packed_random_state(rng) == pack_python_state(rng.getstate())


NUMPY_STEPS: Tuple[Callable[[], Any], ...] = (
    lambda: numpy.random.seed(3),
    lambda: numpy.random.rand(5),
    lambda: numpy.random.rand(1000),  # past the 624 words
    lambda: numpy.random.standard_normal(3),  # an odd count: a Gaussian stays cached
    lambda: numpy.random.standard_normal(4),
    lambda: numpy.random.set_state(("MT19937", numpy.arange(624, dtype=numpy.uint32), 7, 1, -1.5e-3)),
    lambda: numpy.random.set_state(("MT19937", numpy.arange(624, dtype=numpy.uint32), 600, 0, 4.0)),
)


def packed_get_state() -> Tuple[Any, ...]:
    name, key, *rest = numpy.random.get_state()
    return (name, key.tobytes(), *rest)


@pytest.fixture
def numpy_state_kept() -> Any:
    saved = numpy.random.get_state()
    yield
    numpy.random.set_state(saved)


@pytest.mark.usefixtures("numpy_state_kept")
@pytest.mark.parametrize("step", range(len(NUMPY_STEPS)))
def test_numpy_global_state_reads_as_get_state(step: int) -> None:
    reader = NumpyStateReader(numpy)
    assert reader.fast, "this numpy's layout is recognised"
    numpy.random.seed(1)
    NUMPY_STEPS[step]()
    assert reader.read() == packed_get_state()


@pytest.mark.usefixtures("numpy_state_kept")
def test_an_unrecognised_numpy_layout_falls_back_on_get_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rng_memory, "_gauss_fields", lambda numpy: None)
    reader = NumpyStateReader(numpy)
    assert not reader.fast
    numpy.random.standard_normal(3)
    assert reader.read() == packed_get_state()


@pytest.mark.usefixtures("numpy_state_kept")
def test_packed_global_states_set_back_give_the_same_draws() -> None:
    random.gauss(0, 1)
    numpy.random.standard_normal(3)
    saved = packed_global_rng_state()
    first = (random.gauss(0, 1), numpy.random.standard_normal(5).tolist(), torch.rand(3).tolist())
    set_global_rng_state(unpack_global_rng_state(saved))
    again = (random.gauss(0, 1), numpy.random.standard_normal(5).tolist(), torch.rand(3).tolist())
    assert again == first


def test_a_numpy_state_of_an_older_checkpoint_is_read_as_it_is() -> None:
    state = numpy.random.RandomState(4).get_state()
    assert unpack_numpy_state(state) is state
