"""IsolatedRNG: an in-process pipeline and the training loop never see each other's draws."""

from __future__ import annotations

import random
from typing import List, Tuple

import numpy
import torch

from torchdata_snapshot._rng import IsolatedRNG


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


def test_the_pipeline_draws_the_same_whatever_the_caller_draws() -> None:
    assert pipeline_draws(0) == pipeline_draws(5)


def test_the_caller_draws_the_same_whatever_the_pipeline_draws() -> None:
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


def test_the_caller_state_comes_back_even_if_the_pipeline_raises() -> None:
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
