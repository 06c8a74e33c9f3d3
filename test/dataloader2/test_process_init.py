"""process_init_fn: a process's graph made from the whole graph (prepare_worker_graph's, tested in
test_worker_graph.py), then prefetched; a graph with a dispatched part is refused."""

import unittest
from unittest import TestCase

import pytest
from torchdata.dataloader2.graph import traverse_dps
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot.core.worker.process_init import process_init_fn
from torchdata_snapshot.core.worker.worker_graph import DispatchPlaceholder


class TestProcessInit(TestCase):
    def test_the_graph_is_sharded_for_the_worker_named(self) -> None:
        graph = process_init_fn(IterableWrapper(range(9)).sharding_filter(), WorkerInfo(3, 1))
        assert list(graph) == [1, 4, 7]

    def test_the_graph_is_prefetched_after_worker_init_fn(self) -> None:
        graph = process_init_fn(IterableWrapper(range(5)), WorkerInfo(1, 0), lambda dp, _: dp.map(str), 3)
        assert type(graph).__name__ == "PrefetcherIterDataPipe" and graph.buffer_size == 3
        assert list(graph) == ["0", "1", "2", "3", "4"]
        mapped = next(iter(traverse_dps(graph).values()))[1]
        assert type(next(iter(mapped.values()))[0]).__name__ == "MapperIterDataPipe", "init runs first"

    def test_a_graph_with_a_dispatched_part_is_refused_naming_the_worker_loop(self) -> None:
        dispatched = DispatchPlaceholder()  # where the dispatched part was
        with pytest.raises(ProtocolError, match="dispatched part needs exactly one link to the dispatcher"):
            process_init_fn(dispatched.map(abs), WorkerInfo(2, 0))


if __name__ == "__main__":
    unittest.main()
