"""prepare_worker_graph: the graph a worker runs, sharded for it, worker_init_fn applied, and, with
a dispatching process, the source that reads from it where the dispatched part was."""

import unittest
from typing import Any
from unittest import TestCase

import pytest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot.core.worker.worker_graph import DispatchPlaceholder, prepare_worker_graph


def negate(x: int) -> int:
    return -x


class TestWorkerGraph(TestCase):
    def test_the_graph_is_sharded_for_the_worker_named(self) -> None:
        graph = prepare_worker_graph(IterableWrapper(range(9)).sharding_filter(), WorkerInfo(3, 1))
        assert list(graph) == [1, 4, 7]

    def test_worker_init_fn_gets_the_sharded_graph_and_the_worker_info(self) -> None:
        seen = []

        def init(datapipe: IterDataPipe, info: WorkerInfo) -> IterDataPipe:
            seen.append((list(datapipe), info.worker_id, info.num_workers))
            return datapipe.map(negate)

        graph = prepare_worker_graph(IterableWrapper(range(4)).sharding_filter(), WorkerInfo(2, 0), init)
        assert list(graph) == [0, -2]
        assert seen == [([0, 2], 0, 2)], "called once, after sharding"

    def test_the_dispatched_source_takes_the_placeholders_place_and_only_the_rest_is_sharded(self) -> None:
        placeholder = DispatchPlaceholder()  # where DataLoader2 cut the dispatched part out
        own = IterableWrapper(range(100, 106)).sharding_filter()
        graph = placeholder.zip(own)
        dispatched = IterableWrapper(["a", "b", "c"])  # what the dispatching process deals this worker
        made = prepare_worker_graph(graph, WorkerInfo(2, 1), dispatched=dispatched)
        assert list(made) == [("a", 101), ("b", 103), ("c", 105)], (
            "the dispatched items are not sharded again"
        )

    def test_a_placeholder_without_a_dispatched_source_is_refused(self) -> None:
        with pytest.raises(ProtocolError, match="dispatched part needs exactly one link to the dispatcher"):
            prepare_worker_graph(DispatchPlaceholder().map(abs), WorkerInfo(2, 0))

    @parametrize("returned", [3, None, [1, 2]])
    def test_a_worker_init_fn_that_returns_no_datapipe_is_refused(self, returned: Any) -> None:
        with pytest.raises(
            TypeError, match=f"worker_init_fn returned {type(returned).__name__}, not a DataPipe"
        ):
            prepare_worker_graph(IterableWrapper(range(3)), WorkerInfo(1, 0), lambda dp, _: returned)


instantiate_parametrized_tests(TestWorkerGraph)


if __name__ == "__main__":
    unittest.main()
