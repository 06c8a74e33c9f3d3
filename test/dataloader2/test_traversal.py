"""traverse, seed_graph and reset_graph: torchdata's graph, seeds and reset, on one traversal that
does not pickle the data the graph holds."""

import os
import pickle
import random
import unittest
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import torch
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2.graph import DataPipeGraph, list_dps, set_graph_random_seed, traverse_dps
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils.worker import WorkerInfo, process_reset_fn
from torchdata.datapipes.iter import FileLister, IterableWrapper, IterDataPipe
from torchdata.datapipes.map import SequenceWrapper

from torchdata_snapshot.core.traversal import datapipes_in, reset_graph, seed_graph, subgraph, traverse


def _double(x: int) -> int:
    return 2 * x


def _twice(x: int) -> List[int]:
    return [x, x]


def _odd(x: int) -> bool:
    return x % 2 == 1


class _Holding(IterDataPipe):
    """Keeps its input inside a dict inside a list, beside a tensor and a function."""

    def __init__(self, source: IterDataPipe) -> None:
        self.kept = [{"input": source, "weights": torch.ones(4)}]
        self.fn = lambda x: x  # (not picklable: torchdata's traversal looks past it)

    def __iter__(self) -> Iterator[Any]:
        yield from self.kept[0]["input"]


def _shapes() -> Dict[str, Any]:
    """Graphs users build: readers, forks, demux, map-style, dispatching, DataPipes kept in
    collections, tensors and arrays as data."""

    def forked() -> IterDataPipe:
        a, b = IterableWrapper(range(10)).shuffle().sharding_filter().fork(2)
        return a.map(_double).zip(b.filter(_odd).shuffle())  # random before and after the filter

    def demuxed() -> IterDataPipe:
        a, b = IterableWrapper(range(10)).demux(2, _odd)
        return a.mux(b.shuffle()).sharding_filter()

    def files() -> IterDataPipe:
        listed = FileLister(os.path.dirname(__file__), masks="test_*.py").shuffle().sharding_filter()
        return listed.open_files().readlines().batch(4).cycle(2)

    return {
        "forked": forked,
        "files": files,
        "concat_header": lambda: IterableWrapper(range(5)).concat(IterableWrapper(range(3))).header(6),
        "batch_unbatch_flatmap": lambda: (
            IterableWrapper(range(9)).sharding_filter().batch(3).unbatch().flatmap(_twice)
        ),
        "demuxed": demuxed,
        "map_style": lambda: (
            SequenceWrapper(list(range(8))).map(_double).to_iter_datapipe().sharding_filter()
        ),
        "tensors": lambda: (
            IterableWrapper([torch.rand(3) for _ in range(50)])
            .zip(IterableWrapper([np.arange(3) for _ in range(50)]))
            .shuffle()
            .sharding_filter()
        ),
        "held_in_collections": lambda: _Holding(IterableWrapper(range(5)).shuffle()).sharding_filter(),
        "dispatching": lambda: (
            IterableWrapper(range(9))
            .shuffle()
            .sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
            .map(_double)
        ),
    }


def _same_graph(ours: DataPipeGraph, theirs: DataPipeGraph) -> bool:
    """The same DataPipes (by identity) at the same places, in the same order."""
    if list(ours) != list(theirs):
        return False
    return all(ours[key][0] is theirs[key][0] and _same_graph(ours[key][1], theirs[key][1]) for key in ours)


def _seeds(datapipe: Any) -> List[Tuple[str, Any]]:
    """The seed each random DataPipe of the graph was given, output first."""
    return [(type(dp).__name__, dp._seed) for dp in list_dps(traverse_dps(datapipe)) if hasattr(dp, "_seed")]


class TestTraverse(TestCase):
    @parametrize("name", sorted(_shapes()))
    def test_the_graph_of_each_shape_is_torchdatas(self, name: str) -> None:
        datapipe = _shapes()[name]()
        assert _same_graph(traverse(datapipe), traverse_dps(datapipe))

    def test_tensors_and_arrays_the_graph_holds_are_not_pickled(self) -> None:
        datapipe = _shapes()["tensors"]()
        reduce_ex = torch.Tensor.__reduce_ex__

        def refuse(self: torch.Tensor, protocol: int) -> Any:
            raise AssertionError("a tensor was pickled")

        torch.Tensor.__reduce_ex__ = refuse  # type: ignore[method-assign]
        try:
            with self.assertRaises(AssertionError):
                traverse_dps(datapipe)  # (torchdata's pickles them: the check is live)
            graph = traverse(datapipe)
        finally:
            torch.Tensor.__reduce_ex__ = reduce_ex  # type: ignore[method-assign]
        assert [type(dp).__name__ for dp in list_dps(graph)] == [
            "ShardingFilterIterDataPipe", "ShufflerIterDataPipe", "ZipperIterDataPipe",
            "IterableWrapperIterDataPipe", "IterableWrapperIterDataPipe",
        ]  # fmt: skip

    def test_an_object_array_is_looked_into(self) -> None:
        inner = IterableWrapper(range(3))
        held = np.empty(1, dtype=object)
        held[0] = inner
        outer = _Holding(IterableWrapper(range(2)))
        outer.kept.append({"array": held})  # type: ignore[dict-item]
        assert inner in list_dps(traverse(outer))

    def test_the_hooks_are_removed_after_a_traversal_that_raises(self) -> None:
        class Unpicklable(IterDataPipe):
            def __init__(self) -> None:
                self.held = [self._fail]

            def _fail(self) -> None:
                pass

            def __reduce_ex__(self, protocol: Any) -> Any:
                raise TypeError("cannot pickle")

            def __iter__(self) -> Iterator[Any]:
                yield 1

        with self.assertRaises(TypeError):
            traverse(IterableWrapper(range(2)).zip(Unpicklable()).map(_double))
        assert IterDataPipe.getstate_hook is None
        assert traverse(IterableWrapper(range(2)))

    def test_subgraph_and_exclusions_are_list_dps_on_the_same_graph(self) -> None:
        datapipe = _shapes()["forked"]()
        graph = traverse(datapipe)
        sf = [dp for dp in list_dps(graph) if type(dp).__name__ == "ShardingFilterIterDataPipe"][0]
        assert _same_graph(subgraph(graph, sf), traverse_dps(sf))
        assert datapipes_in(graph, [sf]) == list_dps(traverse_dps(datapipe), exclude_dps=[sf])
        assert subgraph(graph, IterableWrapper(range(1))) == {}


class TestSeeding(TestCase):
    @parametrize("name", sorted(_shapes()))
    def test_seed_graph_seeds_as_set_graph_random_seed(self, name: str) -> None:
        ours, theirs = _shapes()[name](), _shapes()[name]()
        generators = SeedGenerator(7), SeedGenerator(7)
        seed_graph(traverse(ours), generators[0])
        set_graph_random_seed(theirs, generators[1])
        assert _seeds(ours) == _seeds(theirs)
        assert all(seed is not None for _, seed in _seeds(ours))
        assert pickle.dumps(generators[0]) == pickle.dumps(generators[1])  # the same draws

    @parametrize("shared", [False, True])
    def test_reset_graph_resets_as_process_reset_fn(self, shared: bool) -> None:
        def iter_reset(dp: IterDataPipe) -> IterDataPipe:
            return dp.map(_double)

        def custom_reset(dp: IterDataPipe, info: WorkerInfo, generator: SeedGenerator) -> IterDataPipe:
            return dp.shuffle().set_seed(generator.generate_seed())

        results = []
        for reset in (reset_graph, process_reset_fn):
            datapipe = _shapes()["forked"]()
            out = reset(
                datapipe, WorkerInfo(2, 1), SeedGenerator(3).spawn(1), shared, iter_reset, custom_reset
            )
            datapipe = out[0] if isinstance(out, tuple) else out
            results.append((list(datapipe), random.random(), torch.rand(1).item(), np.random.rand()))
        assert results[0] == results[1]

    def test_reset_graph_returns_the_graph_of_what_the_reset_functions_return(self) -> None:
        datapipe, graph = reset_graph(
            IterableWrapper(range(4)),
            WorkerInfo(1, 0),
            SeedGenerator(0),
            iter_reset_fn=lambda dp: dp.map(_double),
        )
        assert _same_graph(graph, traverse_dps(datapipe))
        assert list(datapipe) == [0, 2, 4, 6]

    def test_a_reset_function_returning_no_datapipe_is_named(self) -> None:
        with self.assertRaisesRegex(TypeError, "worker_reset_fn returned list, not a DataPipe"):
            reset_graph(
                IterableWrapper(range(4)), WorkerInfo(1, 0), SeedGenerator(0), custom_reset_fn=lambda *a: []
            )


instantiate_parametrized_tests(TestTraverse)
instantiate_parametrized_tests(TestSeeding)

if __name__ == "__main__":
    unittest.main()
