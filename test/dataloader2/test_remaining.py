"""What remains of an epoch resumed elastically (docs: elastic.rst), without processes: the
elements not delivered whole, and how many items of each partly delivered one a new worker skips,
through several elastic resumes of one epoch; the expander that counts them."""

from __future__ import annotations

import unittest
from typing import Any, List
from unittest import TestCase, mock

from torchdata.datapipes.iter import FlatMapper as FlatMapperIterDataPipe
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.core.messages import Level
from torchdata_snapshot.elastic import element_progress
from torchdata_snapshot.elastic.element_progress import with_counting_expander
from torchdata_snapshot.elastic.remaining import Remaining, skips_of_instance
from torchdata_snapshot.graph_state.graph_state import RESUMABLE_ADAPTERS
from torchdata_snapshot.graph_state.resumable import Expander

#: 2 instances: instance 0 had element 0 whole and 1 item of element 2; instance 1 had 2 items
#: of element 1 (elements are dealt round-robin: instance i takes j with j % 2 == i).
FIRST = Level(whole=(1, 0), partial=(1, 2))


class TestRemaining(TestCase):
    def test_an_element_partly_delivered_remains(self) -> None:
        assert list(Remaining(IterableWrapper(range(6)), [FIRST])) == [1, 2, 3, 4, 5]
        assert list(Remaining(IterableWrapper(range(6)), [Level((1, 0), (0, 0))])) == [1, 2, 3, 4, 5]
        assert list(Remaining(IterableWrapper(range(6)), [Level((1, 1), (0, 0))])) == [2, 3, 4, 5]

    def test_the_new_instance_that_is_dealt_a_partly_delivered_element_skips_what_was_delivered(self) -> None:
        # Remaining: 1 (2 items delivered), 2 (1 item), 3, 4, 5; over 3 new instances.
        assert skips_of_instance([FIRST], 3, 0) == {0: 2}
        assert skips_of_instance([FIRST], 3, 1) == {0: 1}
        assert skips_of_instance([FIRST], 3, 2) == {}
        # Over one instance: its elements 0 and 1 are elements 1 and 2 of the epoch.
        assert skips_of_instance([FIRST], 1, 0) == {0: 2, 1: 1}

    def test_a_later_resume_counts_from_the_elements_first_item_and_drops_what_it_delivered_whole(
        self,
    ) -> None:
        # Then 3 instances (dealt 1, 2, 3, 4, 5 round-robin): instance 0 delivered element 1 whole and
        # 1 item of element 4; instance 1 had 3 items of element 2 (its first, skipping 1 of them).
        second = Level(whole=(1, 0, 0), partial=(1, 3, 0))
        # Remaining after both: 2 (3 items), 3, 4 (1 item), 5.
        assert list(Remaining(IterableWrapper(range(6)), [FIRST, second])) == [2, 3, 4, 5]
        assert skips_of_instance([FIRST, second], 1, 0) == {0: 3, 2: 1}
        assert skips_of_instance([FIRST, second], 2, 0) == {0: 3, 1: 1}
        assert skips_of_instance([FIRST, second], 2, 1) == {}

    def test_a_partly_delivered_element_no_later_worker_reached_keeps_its_count(self) -> None:
        untouched = Level(whole=(0, 0, 0), partial=(0, 0, 0))
        assert skips_of_instance([FIRST, untouched], 3, 0) == {0: 2}
        assert skips_of_instance([FIRST, untouched], 3, 1) == {0: 1}


def _twice(x: int) -> List[int]:
    return [x, x]


class TestCountingExpander(TestCase):
    """A worker's graph resumed elastically counts the items of the element its expander is in."""

    def graph(self) -> Any:
        return IterableWrapper(range(4)).sharding_filter().flatmap(_twice).map(str)

    def test_the_expander_after_the_sharding_filter_counts_and_yields_what_it_yielded(self) -> None:
        graph = with_counting_expander(self.graph())
        assert list(graph) == list(self.graph())
        expander = next(dp for _, dp in graph_datapipes(graph) if isinstance(dp, FlatMapperIterDataPipe))
        assert isinstance(expander, Expander)

    def test_an_expander_whose_class_needs_no_adapter_stays_as_it_is(self) -> None:
        """Where the class keeps its own state (torchdata's FlatMapper does, in torchdata's tree),
        there is no adapter to ask: the DataPipe is left as it is."""
        adapters = dict(RESUMABLE_ADAPTERS)
        adapters.pop(FlatMapperIterDataPipe, None)  # (in torchdata's tree, not there at all)
        with mock.patch.dict(element_progress.RESUMABLE_ADAPTERS, adapters, clear=True):
            graph = with_counting_expander(self.graph())
        expander = next(dp for _, dp in graph_datapipes(graph) if isinstance(dp, FlatMapperIterDataPipe))
        assert type(expander) is FlatMapperIterDataPipe and list(graph) == list(self.graph())


if __name__ == "__main__":
    unittest.main()
