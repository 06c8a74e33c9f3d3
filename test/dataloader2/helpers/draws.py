"""Seeded draws for the property tests: configurations and checkpoint positions.

A property test is decorated with ``@examples()`` and takes a ``draw``: it runs once per example
(``test_x_0`` .. ``test_x_19``; 150 with ``--full-matrix``, or the count it asks for). Each
example draws from its own ``random.Random``, seeded with the test's name and the example's
number: the same example draws the same values in every run and on every machine, so a failure
names the example (``test_x_7``), which its node id reruns, and the suite needs nothing beyond
torchdata's test requirements.

Integers are drawn as a property-based tester draws them: often a bound or next to one (the
first and last checkpoint positions, an empty epoch, the item after StopIteration), else
uniformly, so that over the examples every class of position comes up: before the first state
capture, inside an element, on the boundary between elements, at the end of the epoch.
"""

from __future__ import annotations

import os
import random
from typing import Callable, List, Optional, Sequence, TypeVar

from torch.testing._internal.common_utils import parametrize, subtest

T = TypeVar("T")
Test = TypeVar("Test", bound=Callable[..., None])

#: Examples a property test runs: 20, or what the suite's options set (150 with ``--full-matrix``).
EXAMPLES = int(os.environ.get("TORCHDATA_SNAPSHOT_PROPERTY_EXAMPLES", "20"))

#: How often an integer is a bound or next to one rather than uniform.
EDGE_CHANCE = 0.3


class SeededDraw:
    """The values one example of a property test draws, from a generator seeded by ``seed``."""

    def __init__(self, seed: str) -> None:
        self.seed = seed
        self._rng = random.Random(seed)  # a str seed: the same in every process and hash seed

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``: a bound or next to one with ``EDGE_CHANCE``."""
        if low > high:
            raise ValueError(f"an empty range: [{low}, {high}]")
        if self._rng.random() < EDGE_CHANCE:
            edges = sorted({low, min(low + 1, high), max(high - 1, low), high})
            return self._rng.choice(edges)
        return self._rng.randint(low, high)

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``, each as likely."""
        return options[self._rng.randrange(len(options))]

    def boolean(self) -> bool:
        return self._rng.random() < 0.5

    def distinct_integers(self, low: int, high: int, min_size: int, max_size: int) -> List[int]:
        """Between ``min_size`` and ``max_size`` distinct integers of ``[low, high]``, each drawn as
        :meth:`integer` draws, in the order drawn."""
        size = min(self.integer(min_size, max_size), high - low + 1)
        out: List[int] = []
        while len(out) < size:
            value = self.integer(low, high)
            if value not in out:
                out.append(value)
        return out

    def __repr__(self) -> str:
        return f"SeededDraw({self.seed!r})"


def examples(count: Optional[int] = None) -> Callable[[Test], Test]:
    """Run the decorated test (a method of a TestCase given to ``instantiate_parametrized_tests``)
    once per example (``count``, else :data:`EXAMPLES`): ``test_x_0`` .. , its ``draw`` argument a
    :class:`SeededDraw` seeded with the test's name and the example's number."""

    def decorate(test: Test) -> Test:
        n = EXAMPLES if count is None else count
        draws = [subtest(SeededDraw(f"{test.__name__}:{i}"), name=str(i)) for i in range(n)]
        return parametrize("draw", draws)(test)

    return decorate
