"""The property tests' seeded draws (helpers/draws.py): the same example draws the same values in
every run, its integers come up at the bounds as often as inside, and each test runs its count."""

from __future__ import annotations

import unittest
from typing import List
from unittest import TestCase

import pytest
from draws import EDGE_CHANCE, SeededDraw, examples
from torch.testing._internal.common_utils import instantiate_parametrized_tests


def draws_of(seed: str) -> List[object]:
    draw = SeededDraw(seed)
    return [draw.integer(0, 1000), draw.choice("abcdef"), draw.boolean(), draw.distinct_integers(0, 9, 1, 3)]


class TestDraws(TestCase):
    def test_an_example_draws_the_same_values_in_every_run_and_others_than_its_neighbours(self) -> None:
        assert draws_of("test_x:7") == draws_of("test_x:7")
        assert len({repr(draws_of(f"test_x:{i}")) for i in range(20)}) == 20

    def test_integers_stay_in_their_range_and_often_hit_its_bounds(self) -> None:
        draw = SeededDraw("bounds")
        values = [draw.integer(3, 40) for _ in range(2000)]
        assert min(values) == 3 and max(values) == 40
        at_edges = sum(v in (3, 4, 39, 40) for v in values) / len(values)
        assert EDGE_CHANCE * 0.8 < at_edges < EDGE_CHANCE + 0.1, (
            "bounds and their neighbours, about that often"
        )
        assert len(set(values)) == 38, "and every value inside"
        assert {draw.integer(5, 5) for _ in range(10)} == {5}
        with pytest.raises(ValueError, match=r"an empty range: \[2, 1\]"):
            draw.integer(2, 1)

    def test_distinct_integers_are_distinct_within_their_sizes_and_range(self) -> None:
        draw = SeededDraw("distinct")
        for _ in range(200):
            values = draw.distinct_integers(0, 10, min_size=1, max_size=3)
            assert (
                1 <= len(values) <= 3
                and len(set(values)) == len(values)
                and all(0 <= v <= 10 for v in values)
            )
        assert sorted(draw.distinct_integers(0, 1, min_size=3, max_size=3)) == [0, 1], (
            "as many as the range has"
        )

    @examples(7)
    def test_a_property_test_runs_once_per_example_with_a_draw_of_its_own(self, draw: SeededDraw) -> None:
        assert isinstance(draw, SeededDraw) and draw.seed.startswith(
            "test_a_property_test_runs_once_per_example"
        )

    def test_examples_makes_the_count_asked_for_seeded_by_the_tests_name(self) -> None:
        seen: List[str] = []

        class TestP(TestCase):
            @examples(5)
            def test_p(self, draw: SeededDraw) -> None:
                seen.append(draw.seed)

        instantiate_parametrized_tests(TestP)
        names = sorted(name for name in vars(TestP) if name.startswith("test_p"))
        assert names == [f"test_p_{i}" for i in range(5)]
        for name in names:
            getattr(TestP(name), name)()
        assert seen == [f"test_p:{i}" for i in range(5)]


instantiate_parametrized_tests(TestDraws)


if __name__ == "__main__":
    unittest.main()
