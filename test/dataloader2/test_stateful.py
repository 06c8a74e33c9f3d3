"""Stateful restore, DataPipe by DataPipe: the equivalents yield exactly what torchdata's DataPipes
yield, and a graph loaded with a state captured after k items yields exactly the rest."""

from __future__ import annotations

import pickle
import random
import unittest
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, List, Tuple

import pytest
import torch
from pipelines import CountingStateful, double, failing_counter, is_even, split
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2.graph import set_graph_random_seed
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import FileLister, IterableWrapper, IterDataPipe

from torchdata_snapshot import StateRestoreError, register_state_functions
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.graph_state.graph_state import GraphState
from torchdata_snapshot.graph_state.state_functions import _REGISTERED, StateFunctions


def noisy(x: Any) -> Any:
    return (x, random.random())


def collate(batch: List[int]) -> int:
    return sum(batch)


def shard(dp: IterDataPipe, n: int = 3, i: int = 1) -> IterDataPipe:
    torch.utils.data.graph_settings.apply_sharding(dp, n, i, SHARDING_PRIORITIES.MULTIPROCESSING)
    return dp


SHAPES: dict = {
    "iterable_list": lambda: IterableWrapper(list(range(23))),
    "iterable_range_tuple": lambda: IterableWrapper(range(19)).concat(IterableWrapper((5, 6, 7))),
    "map_filter": lambda: IterableWrapper(range(40)).map(double).filter(is_even),
    "sharding": lambda: shard(IterableWrapper(range(50)).sharding_filter()),
    "shuffle_before_sharding": lambda: shard(
        IterableWrapper(range(60)).shuffle(buffer_size=9).sharding_filter()
    ),
    "shuffle_after_sharding": lambda: shard(
        IterableWrapper(range(60)).sharding_filter().shuffle(buffer_size=7)
    ),
    "batch_unbatch": lambda: IterableWrapper(range(31)).batch(4).map(list).unbatch(),
    "batch_collate": lambda: IterableWrapper(range(31)).batch(4, drop_last=True).collate(collate),
    "unbatch_all_levels": lambda: IterableWrapper([[[1, 2], [3]], [[4]], [[5, 6, 7]]] * 3).unbatch(-1),
    "flatmap": lambda: IterableWrapper(range(17)).flatmap(split),
    "header": lambda: IterableWrapper(range(40)).header(25),
    "cycler": lambda: IterableWrapper(range(7)).shuffle().cycle(3),
    "zip": lambda: IterableWrapper(range(20)).zip(IterableWrapper(range(100, 115))),
    "concat": lambda: IterableWrapper(range(5)).concat(
        IterableWrapper(range(10, 18)), IterableWrapper(range(30, 33))
    ),
    "mux": lambda: IterableWrapper(range(9)).mux(
        IterableWrapper(range(100, 120)), IterableWrapper(range(200, 212))
    ),
    "global_rng": lambda: IterableWrapper(range(30)).shuffle().map(noisy),
}


def basename(path: str) -> str:
    return Path(path).name


def files(tmp: Path) -> IterDataPipe:
    for d in ("a", "b"):
        (tmp / d).mkdir(exist_ok=True)
        for i in range(6):
            (tmp / d / f"{i}.txt").write_text(str(i))
    return FileLister([str(tmp / "a"), str(tmp / "b")], masks="*.txt").map(basename)


def resumable(dp: IterDataPipe) -> Tuple[IterDataPipe, GraphState]:
    """``dp`` made resumable, as a worker does, with the graph state that keeps its states."""
    state = GraphState()
    return state.make_resumable(dp), state


def epochs(dp: IterDataPipe, state: GraphState, count: int, first_epoch: int = 0) -> List[List[Any]]:
    """``count`` epochs, each seeded as DataLoader2 would (seeds, then the global RNG)."""
    out = []
    for epoch in range(first_epoch, first_epoch + count):
        state.reset(graph_datapipes(dp))
        set_graph_random_seed(dp, SeedGenerator(epoch))
        random.seed(epoch)
        torch.manual_seed(epoch)
        out.append(list(dp))
    return out


def round_trip(build: Callable[[], IterDataPipe], k: int) -> None:
    """Capture a state after k items of epoch 1, load it into a new graph: the rest of the epoch
    and the next epoch are exactly those of an uninterrupted run."""
    reference = epochs(*resumable(build()), 2, first_epoch=1)
    dp, state = resumable(build())
    state.reset(graph_datapipes(dp))
    set_graph_random_seed(dp, SeedGenerator(1))
    random.seed(1)
    torch.manual_seed(1)
    it = iter(dp)
    head = [next(it) for _ in range(k)]
    blob = state.capture(graph_datapipes(dp))
    assert head == reference[0][:k]

    again, again_state = resumable(build())
    again_state.reset(graph_datapipes(again))
    set_graph_random_seed(again, SeedGenerator(1))
    random.seed(12345)  # whatever the global RNGs hold: the state brings the pipeline's back
    torch.manual_seed(12345)
    again_state.load(graph_datapipes(again), blob)
    assert list(again) == reference[0][k:]
    assert epochs(again, again_state, 1, first_epoch=2) == reference[1:]


class Opaque(IterDataPipe):
    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        start, self.start = self.start, 0
        yield from range(start, self.n)


class OpaqueSubclass(Opaque):
    pass


class CountedReads(Sequence):
    """A sequence that records which of its items were read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: List[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: Any) -> int:
        if not isinstance(index, int) or not 0 <= index < self.n:
            raise IndexError(index)
        self.reads.append(index)
        return index


def middle_state(shape: str) -> tuple:
    """A graph of ``shape`` halfway through epoch 1, and its captured states (unpickled)."""
    dp, state = resumable(SHAPES[shape]())
    state.reset(graph_datapipes(dp))
    set_graph_random_seed(dp, SeedGenerator(1))
    it = iter(dp)
    for _ in range(5):
        next(it)
    return dp, pickle.loads(state.capture(graph_datapipes(dp)))


def wrong_states(state: Any) -> List[Any]:
    """States of the wrong shape for a DataPipe whose state is ``state``: not a dict, a field
    missing, an unknown field, each field of another type or negative."""
    wrong: List[Any] = [None, [], {**state, "unknown": 0}]
    for name, value in state.items():
        wrong.append({k: v for k, v in state.items() if k != name})
        wrong.append({**state, name: object()})
        if isinstance(value, int) and not isinstance(value, bool):
            wrong.append({**state, name: -1})
    return wrong


class TestStateful(SuiteTestCase):
    @parametrize("shape", sorted(SHAPES))
    def test_the_equivalents_yield_exactly_what_the_originals_yield(self, shape: str) -> None:
        assert GraphState().unresumable(SHAPES[shape]()) is None
        assert epochs(*resumable(SHAPES[shape]()), 3) == epochs(SHAPES[shape](), GraphState(), 3)

    def test_file_lister_equivalent(self) -> None:
        assert epochs(*resumable(files(self.tmp_path)), 2) == epochs(files(self.tmp_path), GraphState(), 2)

    @parametrize("where", ["start", "middle", "end"])
    @parametrize("shape", sorted(SHAPES))
    def test_save_and_load_round_trip(self, shape: str, where: str) -> None:
        length = len(epochs(*resumable(SHAPES[shape]()), 1, first_epoch=1)[0])
        round_trip(SHAPES[shape], {"start": 0, "middle": length // 2, "end": length}[where])

    def test_file_lister_round_trip(self) -> None:
        for k in (0, 4, 7, 12):
            round_trip(lambda: files(self.tmp_path), k)

    def test_a_datapipe_with_its_own_state_methods_resumes(self) -> None:
        round_trip(lambda: CountingStateful(30).map(double), 11)

    def test_unknown_datapipes_keep_the_graph_on_replay_until_registered(self) -> None:
        assert GraphState().unresumable(Opaque(5).map(double)).endswith("Opaque")
        assert (
            GraphState().unresumable(IterableWrapper(iter(range(3)))).endswith("IterableWrapperIterDataPipe")
        )
        register_state_functions(Opaque, lambda dp: {"n": dp.n}, lambda dp, state: None)
        try:
            assert GraphState().unresumable(Opaque(5).map(double)) is None
            assert GraphState().unresumable(OpaqueSubclass(5)).endswith("OpaqueSubclass"), (
                "the exact type only"
            )
        finally:
            delattr(Opaque, _REGISTERED)

    def test_a_graph_state_uses_the_state_functions_it_was_sent(self) -> None:
        """As in a worker started by spawn, which did not run the code that registered them."""
        assert GraphState().unresumable(Opaque(5)) is not None, "not registered in this process"
        sent = StateFunctions(Opaque, lambda dp: {"start": dp.start}, lambda dp, state: None)
        assert GraphState((sent,)).unresumable(Opaque(5)) is None

    def test_a_failing_load_state_dict_names_the_datapipe(self) -> None:
        dp = failing_counter(10)
        blob = GraphState().capture(graph_datapipes(CountingStateful(10)))
        with pytest.raises(
            StateRestoreError, match=r"load_state_dict\(\) of DataPipe 0:CountingStateful .* another dataset"
        ):
            GraphState().load(graph_datapipes(dp), blob)

    def test_the_sharding_filter_is_kept_so_that_seeding_still_finds_it(self) -> None:
        from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe

        dp, _ = resumable(SHAPES["shuffle_before_sharding"]())
        kinds = [type(d) for _, d in graph_datapipes(dp)]
        assert ShardingFilterIterDataPipe in kinds, "torchdata's ShardingFilter stays in the graph"
        assert len(kinds) == 3, "and nothing is inserted under it"

    def test_a_resumed_iterable_wrapper_reads_nothing_before_its_position(self) -> None:
        source = CountedReads(100_000)
        dp, _ = resumable(IterableWrapper(source, deepcopy=False))
        dp.load_state_dict({"position": 99_990})
        assert next(iter(dp)) == 99_990
        assert source.reads == [99_990], "a restore at k must not walk the k items before it"

    @parametrize("shape", sorted(SHAPES))
    def test_a_state_of_the_wrong_shape_is_refused_when_loaded_naming_the_datapipe(self, shape: str) -> None:
        dp, states = middle_state(shape)
        keys = [key for key in states if key != "__global_rng__"]
        assert keys, "the graph has states to damage"
        for key in keys:
            for wrong in wrong_states(states[key]):
                again, state = resumable(SHAPES[shape]())
                state.reset(graph_datapipes(again))
                blob = pickle.dumps({**states, key: wrong})
                with pytest.raises(StateRestoreError, match=rf"DataPipe {key} "):
                    state.load(graph_datapipes(again), blob)

    def test_a_position_past_the_data_is_refused_when_loaded(self) -> None:
        for shape, key, field in (
            ("iterable_list", "0:ResumableIterableWrapper", "position"),
            ("concat", "0:ResumableConcater", "index"),
        ):
            dp, states = middle_state(shape)
            blob = pickle.dumps({**states, key: {**states[key], field: 10**6}})
            again, state = resumable(SHAPES[shape]())
            with pytest.raises(StateRestoreError, match="past the end|does not exist"):
                state.load(graph_datapipes(again), blob)

    def test_a_blob_that_is_not_a_graph_state_is_refused(self) -> None:
        for blob in (
            b"garbage",
            pickle.dumps([1, 2]),
            pickle.dumps({"0": {}}),
            pickle.dumps({"__global_rng__": 1}),
        ):
            again, state = resumable(SHAPES["iterable_list"]())
            with pytest.raises(StateRestoreError, match="the worker's graph state cannot be loaded"):
                state.load(graph_datapipes(again), blob)

    def test_rng_states_are_packed_and_a_blob_of_the_previous_layout_still_loads(self) -> None:
        """Captures store the Mersenne Twister words and torch's state as bytes (they pickle ten
        times faster); blobs written before, with tuples of ints and a tensor, load the same."""
        from torchdata_snapshot.checkpoint.rng_states import unpack_global_rng_state, unpack_python_state

        dp, state = resumable(SHAPES["global_rng"]())
        state.reset(graph_datapipes(dp))
        set_graph_random_seed(dp, SeedGenerator(1))
        it = iter(dp)
        for _ in range(5):
            next(it)
        states = pickle.loads(state.capture(graph_datapipes(dp)))
        rest = list(it)
        python_state, torch_state, _ = states["__global_rng__"]
        assert isinstance(python_state[1], bytes) and isinstance(torch_state, bytes)
        shuffler = next(key for key in states if "Shuffler" in key)
        assert isinstance(states[shuffler]["rng"][1], bytes)
        old = {**states, "__global_rng__": unpack_global_rng_state(states["__global_rng__"])}
        old[shuffler] = {**states[shuffler], "rng": unpack_python_state(states[shuffler]["rng"])}
        assert isinstance(old["__global_rng__"][1], torch.Tensor) and len(old[shuffler]["rng"][1]) == 625
        for blob in (pickle.dumps(states), pickle.dumps(old)):
            again, again_state = resumable(SHAPES["global_rng"]())
            again_state.reset(graph_datapipes(again))
            again_state.load(graph_datapipes(again), blob)
            assert list(again) == rest


instantiate_parametrized_tests(TestStateful)


if __name__ == "__main__":
    unittest.main()
