"""The core's outlet: what the user received, its position in the workers' streams, the
epoch an iterator belongs to."""

from __future__ import annotations

import unittest
from collections import deque
from typing import Iterator, List

import pytest
from suite_case import SuiteTestCase
from torch.utils.data import IterDataPipe
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.positions import UserPositions


class Tagged(IterDataPipe):
    """Stands in for the consumer: yields items, recording for each that worker ``x % 2`` sent it."""

    def __init__(self, items: List[int], positions: UserPositions) -> None:
        self.items = items
        self.positions = positions

    def __iter__(self) -> Iterator[int]:
        for x in self.items:
            self.positions.handed_on(x % 2)
            yield x


class TestOutlet(SuiteTestCase):
    def test_counts_what_the_user_received_and_the_end_of_the_epoch(self) -> None:
        outlet = Outlet(IterableWrapper(range(3)))
        outlet.start_epoch(0)
        it = iter(outlet)
        assert next(it) == 0 and (outlet.delivered, outlet.finished) == (1, False)
        assert list(it) == [1, 2] and (outlet.delivered, outlet.finished) == (3, True)

    def test_tracks_the_users_position_in_each_worker_stream(self) -> None:
        positions = UserPositions(2)
        outlet = Outlet(Tagged([0, 1, 2, 4, 3], positions), positions)
        outlet.start_epoch(0)
        it = iter(outlet)
        assert [next(it) for _ in range(4)] == [0, 1, 2, 4]
        assert positions.delivered == [3, 1] and positions.last_worker == 0

    def test_a_restored_position_is_taken_up(self) -> None:
        positions = UserPositions(2)
        outlet = Outlet(IterableWrapper([]), positions)
        outlet.start_epoch(1, delivered=5, worker_delivered=[3, 2], last_worker=0)
        assert outlet.positions is positions and positions.delivered == [3, 2]
        assert (outlet.delivered, positions.last_worker, positions.next_worker) == (5, 0, 1)

    def test_an_iterator_of_an_older_epoch_is_over(self) -> None:
        outlet = Outlet(IterableWrapper(range(5)))
        outlet.start_epoch(0)
        old = iter(outlet)
        next(old)
        outlet.start_epoch(1)
        with pytest.raises(StopIteration):
            next(old)
        assert deque(iter(outlet)) == deque(range(5))

    def test_the_outlet_iterator_is_not_wrapped_by_torchs_hook(self) -> None:
        """Torch's DataPipe hook costs about 1 us per item; the outlet checks its own epochs and
        counts its own items (the count torch would keep is what it delivered)."""
        outlet = Outlet(IterableWrapper(range(3)))
        outlet.start_epoch(0)
        it = iter(outlet)
        assert type(it).__name__ == "OutletIterator"
        assert list(it) == [0, 1, 2] and outlet._number_of_samples_yielded == 3


if __name__ == "__main__":
    unittest.main()
