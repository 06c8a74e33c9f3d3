"""Every resumable DataPipe, alone and in compositions, restored from a captured state at any
position, continues exactly as the uninterrupted run: item by item, to the end of the epoch and
through the next one. This is what a worker does on a stateful restore (see the docs' design
page), run in this process so that the property tests can try many positions and shardings
(helpers/draws.py).

``COMPOSITIONS`` must use every DataPipe type stateful restore knows (its adapters, the types it
treats as stateless and the sharding filter, which has built-in state functions): a type cannot
be made resumable without being covered here (``test_every_registered_datapipe_is_covered``).
"""

from __future__ import annotations

import random
import unittest
from typing import Any, Dict, Iterator, List, Tuple

import torch
from compositions import NAMES, Build, compositions, write_files
from draws import SeededDraw, examples
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import set_graph_random_seed
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterDataPipe

from torchdata_snapshot.core.catalogue import types_where
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.graph_state.graph_state import RESUMABLE_ADAPTERS, RESUMABLE_STATELESS, GraphState
from torchdata_snapshot.graph_state.resumable import Resumable

#: A worker's graph and the graph state that keeps its states.
Graph = Tuple[IterDataPipe, GraphState]


def sharded(build: Build, num_instances: int, instance_id: int) -> IterDataPipe:
    """The graph a worker receives: sharded for worker ``instance_id``."""
    dp = build()
    torch.utils.data.graph_settings.apply_sharding(
        dp, num_instances, instance_id, SHARDING_PRIORITIES.MULTIPROCESSING
    )
    return dp


def worker_graph(build: Build, num_instances: int, instance_id: int, adapt: bool = True) -> Graph:
    """The graph a worker runs: sharded for worker ``instance_id``, then made resumable."""
    state = GraphState()
    dp = sharded(build, num_instances, instance_id)
    return (state.make_resumable(dp) if adapt else dp), state


def start_epoch(graph: Graph, epoch: int) -> Iterator[Any]:
    """Seed the graph for ``epoch`` as a worker does (graph seeds, then its global RNGs) and make
    its iterator."""
    dp, state = graph
    state.reset(graph_datapipes(dp))
    set_graph_random_seed(dp, SeedGenerator(epoch))
    random.seed(epoch)
    torch.manual_seed(epoch)
    return iter(dp)


def run_epochs(graph: Graph, count: int) -> List[List[Any]]:
    return [list(start_epoch(graph, epoch)) for epoch in range(count)]


def restored(build: Build, sharding: Tuple[int, int], epoch: int, blob: bytes) -> Tuple[Graph, Any]:
    """A new graph brought to ``blob`` the way a worker's restore does: reset to the epoch (an
    iterator is made and never advanced), load the state, iterate afresh."""
    graph = worker_graph(build, *sharding)
    start_epoch(graph, epoch)
    random.seed(12345)  # whatever the global RNGs hold: the state brings the pipeline's back
    torch.manual_seed(12345)
    dp, state = graph
    state.load(graph_datapipes(dp), blob)
    return graph, iter(dp)


def state_of(graph: Graph) -> bytes:
    """The graph's state, captured as a worker does."""
    dp, state = graph
    return state.capture(graph_datapipes(dp))


def at_epoch(build: Build, sharding: Tuple[int, int], epoch: int) -> Tuple[Graph, Iterator[Any]]:
    """A worker's graph run through the epochs before ``epoch``, and its iterator of ``epoch``."""
    graph = worker_graph(build, *sharding)
    for e in range(epoch):
        list(start_epoch(graph, e))
    return graph, start_epoch(graph, epoch)


def check_restore_at(build: Build, sharding: Tuple[int, int], epoch: int, positions: List[int]) -> None:
    """Capture at every position of ``positions`` in ``epoch``; each restore yields exactly the
    rest of the epoch, then the next epoch."""
    reference = run_epochs(worker_graph(build, *sharding), epoch + 2)
    graph, it = at_epoch(build, sharding, epoch)
    blobs: List[Tuple[int, bytes]] = []
    head: List[Any] = []
    for k in sorted(positions):
        head.extend(next(it) for _ in range(k - len(head)))
        blobs.append((k, state_of(graph)))
    assert head + list(it) == reference[epoch], "capturing states changed the data"
    for k, blob in blobs:
        again, rest = restored(build, sharding, epoch, blob)
        assert list(rest) == reference[epoch][k:], f"the rest of epoch {epoch} after item {k}"
        assert list(start_epoch(again, epoch + 1)) == reference[epoch + 1], "the next epoch"


def check_chained_restore(build: Build, sharding: Tuple[int, int], epoch: int, k: int, more: int) -> None:
    """Capture after ``k`` items, restore, take ``more`` items, capture again and restore from that:
    the rest of the epoch is exactly the uninterrupted run's. (Right after a restore a reader or
    ``unbatch`` finishes its element before it pulls from its source, whose loaded state the
    second capture must carry.)"""
    reference = run_epochs(worker_graph(build, *sharding), epoch + 1)[epoch]
    graph, it = at_epoch(build, sharding, epoch)
    head = [next(it) for _ in range(k)]
    again, rest = restored(build, sharding, epoch, state_of(graph))
    head += [next(rest) for _ in range(more)]
    _, rest = restored(build, sharding, epoch, state_of(again))
    assert head + list(rest) == reference, f"restored after {k}, then after {more} more"


def draw_sharding(draw: SeededDraw) -> Tuple[int, int]:
    """``(num_instances, instance_id)``: 1 to 3 instances, and one of them."""
    num_instances = draw.integer(1, 3)
    return num_instances, draw.integer(0, num_instances - 1)


class TestStatefulEquivalence(SuiteTestCase):
    compositions: Dict[str, Build]  # over files of a directory of the class's own

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.compositions = compositions(write_files(cls.class_directory("files")))

    def test_every_registered_datapipe_is_covered(self) -> None:
        covered = {type(dp) for build in self.compositions.values() for _, dp in graph_datapipes(build())}
        registered = set(types_where(adapted=True)) | set(RESUMABLE_STATELESS) | {ShardingFilterIterDataPipe}
        missing = sorted(kind.__name__ for kind in registered - covered)
        assert not missing, f"resumable DataPipes without an equivalence test: {missing}"

    @parametrize("name", NAMES)
    def test_each_composition_is_resumable_and_yields_what_the_original_yields(self, name: str) -> None:
        build = self.compositions[name]
        for sharding in [(1, 0), (3, 1)]:
            assert GraphState().unresumable(sharded(build, *sharding)) is None
            adapted = run_epochs(worker_graph(build, *sharding), 3)
            assert adapted == run_epochs(worker_graph(build, *sharding, adapt=False), 3), sharding

    @parametrize("name", NAMES)
    def test_each_composition_restores_exactly_at_its_start_middle_and_end(self, name: str) -> None:
        build = self.compositions[name]
        for sharding in [(1, 0), (2, 0), (3, 2)]:
            length = len(run_epochs(worker_graph(build, *sharding), 2)[1])
            check_restore_at(build, sharding, 1, [0, 1, length // 2, max(0, length - 1), length])

    @examples(200)
    def test_any_composition_restores_exactly_at_random_positions(self, draw: SeededDraw) -> None:
        build, sharding, epoch = (
            self.compositions[draw.choice(NAMES)],
            draw_sharding(draw),
            draw.integer(0, 1),
        )
        length = len(run_epochs(worker_graph(build, *sharding), epoch + 1)[epoch])
        check_restore_at(build, sharding, epoch, draw.distinct_integers(0, length, min_size=1, max_size=3))

    @parametrize("name", NAMES)
    def test_each_composition_restores_exactly_from_a_state_captured_after_a_restore(self, name: str) -> None:
        build = self.compositions[name]
        for sharding in [(1, 0), (3, 2)]:
            length = len(run_epochs(worker_graph(build, *sharding), 2)[1])
            for k, more in [
                (1, 1),
                (length // 2, 1),
                (length // 3, length // 3),
                (length - 1, 1),
                (length, 0),
            ]:
                k = max(0, min(k, length))
                check_chained_restore(build, sharding, 1, k, min(more, length - k))

    @examples(150)
    def test_any_composition_restores_exactly_from_states_captured_after_restores(
        self, draw: SeededDraw
    ) -> None:
        build, sharding = self.compositions[draw.choice(NAMES)], draw_sharding(draw)
        length = len(run_epochs(worker_graph(build, *sharding), 1)[0])
        k = draw.integer(0, length)
        check_chained_restore(build, sharding, 0, k, draw.integer(0, length - k))

    def test_the_types_stateful_restore_replaces_are_the_catalogues_adapted_ones(self) -> None:
        """Each type the catalogue calls adapted keeps its state in its own class or has an adapter."""
        own = {kind for kind in types_where(adapted=True) if issubclass(kind, Resumable)}
        assert set(RESUMABLE_ADAPTERS) == set(types_where(adapted=True)) - own
        assert set(RESUMABLE_STATELESS) == set(types_where(stateless=True))


instantiate_parametrized_tests(TestStatefulEquivalence)


if __name__ == "__main__":
    unittest.main()
