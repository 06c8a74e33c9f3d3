"""process_init_fn: a process's graph made from the whole graph, sharded for its worker,
worker_init_fn applied, prefetched; a graph with a dispatched part is refused."""

from typing import Any

import pytest
from torchdata.dataloader2.graph import traverse_dps
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from torchdata_snapshot._compat import DispatchPlaceholder
from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot.core.worker.process_init import process_init_fn


def negate(x: int) -> int:
    return -x


def three(datapipe: IterDataPipe, info: WorkerInfo) -> int:
    return 3


def test_the_graph_is_sharded_for_the_worker_named() -> None:
    graph = process_init_fn(IterableWrapper(range(9)).sharding_filter(), WorkerInfo(3, 1))
    assert list(graph) == [1, 4, 7]


def test_worker_init_fn_gets_the_sharded_graph_and_the_worker_info() -> None:
    seen = []

    def init(datapipe: IterDataPipe, info: WorkerInfo) -> IterDataPipe:
        seen.append((list(datapipe), info.worker_id, info.num_workers))
        return datapipe.map(negate)

    graph = process_init_fn(IterableWrapper(range(4)).sharding_filter(), WorkerInfo(2, 0), init)
    assert list(graph) == [0, -2]
    assert seen == [([0, 2], 0, 2)], "called once, after sharding"


def test_the_graph_is_prefetched_after_worker_init_fn() -> None:
    graph = process_init_fn(IterableWrapper(range(5)), WorkerInfo(1, 0), lambda dp, _: dp.map(str), 3)
    assert type(graph).__name__ == "PrefetcherIterDataPipe" and graph.buffer_size == 3
    assert list(graph) == ["0", "1", "2", "3", "4"]
    mapped = next(iter(traverse_dps(graph).values()))[1]
    assert type(next(iter(mapped.values()))[0]).__name__ == "MapperIterDataPipe", "init runs first"


def test_a_graph_with_a_dispatched_part_is_refused_naming_the_worker_loop() -> None:
    dispatched = DispatchPlaceholder()  # where the dispatched part was
    with pytest.raises(ProtocolError, match="dispatched part needs exactly one link to the dispatcher"):
        process_init_fn(dispatched.map(abs), WorkerInfo(2, 0))


@pytest.mark.parametrize("returned", [3, None, [1, 2]])
def test_a_worker_init_fn_that_returns_no_datapipe_is_refused(returned: Any) -> None:
    with pytest.raises(TypeError, match=f"worker_init_fn returned {type(returned).__name__}, not a DataPipe"):
        process_init_fn(IterableWrapper(range(3)), WorkerInfo(1, 0), lambda dp, _: returned)
