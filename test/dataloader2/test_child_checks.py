"""torch's iterator hook asks every DataPipe, at every item, whether it is a fork()/demux() child;
the graphs the reading service runs answer once instead of failing an attribute lookup per
DataPipe per item, and torch's iterator checks stay what they were."""

from __future__ import annotations

import unittest
from typing import Any, List

import pytest
from suite_case import SuiteTestCase
from torch.utils.data import IterDataPipe
from torchdata.dataloader2.graph import list_dps, traverse_dps
from torchdata.datapipes.iter import IterableWrapper
from worker_driver import items_of, reset, serve

from torchdata_snapshot import MultiProcessingReadingService
from torchdata_snapshot._compat.datapipes import answer_child_checks
from torchdata_snapshot.core import messages as m


def _add_one(x: int) -> int:
    return x + 1


def tiny_graph(n: int = 50) -> IterDataPipe:
    return IterableWrapper(range(n)).shuffle().sharding_filter().map(_add_one)


def graph_of(dp: IterDataPipe) -> List[Any]:
    return list_dps(traverse_dps(dp))


class TestChildChecks(SuiteTestCase):
    def count_failed_child_lookups(self) -> List[int]:
        """From now on, counts the lookups of ``_is_child_datapipe`` that fall through to
        ``IterDataPipe.__getattr__`` (which raises for ``hasattr`` to catch)."""
        count = [0]
        fallback = IterDataPipe.__getattr__

        def counting(dp: Any, name: str) -> Any:
            if name == "_is_child_datapipe":
                count[0] += 1
            return fallback(dp, name)

        self.monkeypatch.setattr(IterDataPipe, "__getattr__", counting)
        return count

    def test_unanswered_every_datapipe_fails_a_lookup_at_every_item(self) -> None:
        failed = self.count_failed_child_lookups()
        assert list(tiny_graph(50)) and failed[0] >= 4 * 50

    def test_an_answered_graph_iterates_without_a_failed_lookup(self) -> None:
        dp = tiny_graph(50)
        answer_child_checks(graph_of(dp))
        failed = self.count_failed_child_lookups()
        assert sorted(dp) == list(range(1, 51))
        assert failed[0] == 0

    def test_a_second_iterator_still_invalidates_the_first(self) -> None:
        dp = IterableWrapper(range(10)).map(_add_one)
        answer_child_checks(graph_of(dp))
        first, second = iter(dp), iter(dp)
        assert next(first) == 1 and next(second) == 1
        with pytest.raises(RuntimeError, match="single iterator per IterDataPipe constraint"):
            next(first)

    def test_fork_children_keep_their_own_answer_and_checks(self) -> None:
        left, right = IterableWrapper(range(10)).fork(2)
        answer_child_checks([left, right, *graph_of(left)])
        assert "_is_child_datapipe" not in vars(left) and left._is_child_datapipe is True
        old, new = iter(left), iter(right)
        assert next(old) == 0 and next(new) == 0
        with pytest.warns(UserWarning, match="not exhausted"):
            renewed = iter(left)  # a new iteration of the pair invalidates the old iterator
        assert next(renewed) == 0
        with pytest.raises(RuntimeError, match="invalidated"):
            next(old)

    def test_the_worker_loop_answers_for_the_graph_each_epoch_runs(self) -> None:
        failed = self.count_failed_child_lookups()
        responses = serve(tiny_graph(40), [reset(0), m.GetNextRequest(0, 100)])
        assert sorted(items_of(responses)) == list(range(1, 41))
        assert failed[0] == 0

    def test_the_main_process_answers_for_what_it_iterates_with_workers(self) -> None:
        failed = self.count_failed_child_lookups()  # (counts this process's lookups only)
        dl = self.make_dl(tiny_graph(40).batch(4), MultiProcessingReadingService(num_workers=1))
        assert sorted(x for batch in dl for x in batch) == list(range(1, 41))
        assert failed[0] == 0

    def test_num_workers_0_answers_for_its_graph(self) -> None:
        failed = self.count_failed_child_lookups()
        dl = self.make_dl(tiny_graph(40), MultiProcessingReadingService(num_workers=0))
        assert sorted(dl) == list(range(1, 41))
        assert failed[0] == 0


if __name__ == "__main__":
    unittest.main()
