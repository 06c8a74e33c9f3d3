"""State functions registered for a DataPipe type: recorded on exactly that class (a subclass is
not registered by inheritance), found for the types of a graph, and refused when they could not
reach workers started by spawn or forkserver."""

import unittest
from typing import Any, Dict, Iterator

from torch.testing._internal.common_utils import TestCase
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from torchdata_snapshot._errors import StateCaptureError
from torchdata_snapshot.graph_state.state_functions import (
    StateFunctions,
    check_state_functions_pickle,
    graph_state_functions,
    register_state_functions,
    registered_state_functions,
)


class Counter(IterDataPipe):
    def __init__(self, source: IterDataPipe) -> None:
        self.source, self.seen = source, 0

    def __iter__(self) -> Iterator[Any]:
        for x in self.source:
            self.seen += 1
            yield x


class SubCounter(Counter):
    pass


class LambdaCounter(Counter):
    """Registered with a lambda by one test only."""


def counter_state(dp: Counter) -> Dict[str, int]:
    return {"seen": dp.seen}


def load_counter_state(dp: Counter, state: Dict[str, int]) -> None:
    dp.seen = state["seen"]


class TestStateFunctions(TestCase):
    def setUp(self) -> None:
        super().setUp()
        register_state_functions(Counter, counter_state, load_counter_state)

    def test_a_registration_is_recorded_on_exactly_that_class(self) -> None:
        found = registered_state_functions(Counter)
        self.assertEqual(found, StateFunctions(Counter, counter_state, load_counter_state))
        self.assertIsNone(registered_state_functions(SubCounter), "not by inheritance")
        self.assertIsNone(registered_state_functions(IterableWrapper))

    def test_the_graphs_registered_types_are_found_once_each(self) -> None:
        graph = Counter(Counter(IterableWrapper(range(3)))).map(abs)
        self.assertEqual(graph_state_functions(graph), (registered_state_functions(Counter),))
        self.assertEqual(graph_state_functions(SubCounter(IterableWrapper([]))), ())

    def test_functions_that_cannot_reach_a_spawned_worker_are_refused_naming_the_type(self) -> None:
        check_state_functions_pickle(graph_state_functions(Counter(IterableWrapper([]))), "spawn")
        register_state_functions(LambdaCounter, lambda dp: {}, load_counter_state)
        carried = graph_state_functions(LambdaCounter(IterableWrapper([])))
        with self.assertRaisesRegex(StateCaptureError, r"for .*LambdaCounter cannot be sent .* 'spawn'"):
            check_state_functions_pickle(carried, "spawn")


if __name__ == "__main__":
    unittest.main()
