"""checkpoint()/restore() through DataLoader2's API, in this process: what a user sees."""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import unittest
from typing import Any, Callable, Dict, Iterator, Tuple

import pytest
from conftest import START_METHODS, start_methods
from digest_items import (
    conj_imag_item,
    holding_itself_item,
    padded_arrays_item,
    same_holding_itself,
    same_values,
)
from faults import ChangesOnceMarked, OffByOneState, SystemRandomOrder, unseeded_noise
from pipelines import (
    NonReplicable,
    credit_window_of,
    double,
    hash_tokens,
    kept_per_worker,
    moved_onto,
    pipeline,
    rs,
    scaled,
    take,
    tiny,
)
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    subtest,
)
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import FileLister, IterableWrapper, IterDataPipe

from torchdata_snapshot import (
    BatchingOptions,
    IncompatibleCheckpointError,
    InvalidCheckpointError,
    MultiProcessingReadingService,
    ReadingServiceError,
    ReplayDivergenceError,
    load_state_dict,
)
from torchdata_snapshot.checkpoint.format import Checkpoint


def restored(make_dl: Any, state: Any, service: Any = None) -> DataLoader2:
    dl = DataLoader2.from_state(state, service if service is not None else rs(2))
    make_dl.created.append(dl)  # shut down with the test's other loaders
    return dl


#: Pipelines built with an argument ``k``: the value the state is taken with, another value,
#: and what the refusal says.
ARGUMENT_CHANGES = {
    "batch": (
        lambda k: IterableWrapper(range(60)).shuffle().sharding_filter().batch(k),
        4,
        5,
        "DataPipe 0:BatcherIterDataPipe: batch_size was 4 in the checkpoint, is 5 now",
    ),
    "shuffle": (
        lambda k: IterableWrapper(range(60)).shuffle(buffer_size=k).sharding_filter().map(double),
        16,
        8,
        "DataPipe 2:ShufflerIterDataPipe: buffer_size was 16 in the checkpoint, is 8 now",
    ),
    "partial": (
        lambda k: IterableWrapper(range(60)).sharding_filter().map(functools.partial(scaled, factor=k)),
        2,
        3,
        "DataPipe 0:MapperIterDataPipe: fn.factor was 2 in the checkpoint, is 3 now",
    ),
}


class ResetsItsCount(IterDataPipe):
    """A DataPipe of one's own with state functions whose ``__iter__`` starts its count again, so
    that a restore loses the count ``load_state_dict()`` loaded."""

    def __init__(self, source: IterDataPipe) -> None:
        self.source = source
        self.count = 0

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        self.count = 0
        for x in self.source:
            self.count += 1
            yield x, self.count

    def state_dict(self) -> Dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.count = state["count"]


def _write_lines(root: str) -> None:
    for shard in range(3):
        with open(os.path.join(root, f"shard{shard}.txt"), "w") as f:
            f.writelines(f"line {i} of shard {shard}\n" for i in range(20))


@instantiate_parametrized_tests
class TestReaderArgumentsOfARestore(SuiteTestCase):
    """A reader's argument that changes the data is refused before any worker starts (not left to
    the replay, which would end in ``ReplayDivergenceError``); another spelling of the same
    setting resumes exactly (``test_arguments.py`` has every reader)."""

    def setUp(self) -> None:
        super().setUp()
        self.root = str(self.tmp_path)
        _write_lines(self.root)

    def _lines(self, mode: str = "r", strip_newline: bool = True) -> Any:
        files = FileLister(self.root, masks="*.txt").sharding_filter().open_files(mode=mode)
        return files.readlines(strip_newline=strip_newline, return_path=False)

    def test_a_changed_strip_newline_is_refused_before_any_worker_starts(self) -> None:
        dl = self.make_dl(self._lines(strip_newline=True), rs(2))
        take(iter(dl), 7)
        state = moved_onto(dl.state_dict(), self._lines(strip_newline=False))
        children = set(multiprocessing.active_children())
        with self.assertRaises(IncompatibleCheckpointError) as raised:
            list(restored(self.make_dl, state))
        self.assertExpectedInline(
            str(raised.exception),
            """the checkpoint was taken with other arguments of its DataPipes (DataPipe 0:LineReaderIterDataPipe: strip_newline was True in the checkpoint, is False now): restore it with the arguments it was taken with (troubleshooting: docs/troubleshooting.rst#incompatiblecheckpointerror)""",  # noqa: E501
        )
        self.assertEqual(set(multiprocessing.active_children()), children, "no worker was started")

    @parametrize("context", START_METHODS)
    def test_another_spelling_of_the_open_mode_resumes_exactly(self, context: str) -> None:
        dl = self.make_dl(self._lines(mode="rt"), rs(2, multiprocessing_context=context))
        it = iter(dl)
        take(it, 7)
        state = dl.state_dict()
        rest = list(it)
        self.assertEqual(len(rest), 60 - 7)
        resumed = restored(
            self.make_dl, moved_onto(state, self._lines(mode="r")), rs(2, multiprocessing_context=context)
        )
        self.assertEqual(list(resumed), rest)


#: Where a restore replays: in the workers (by replay, or from states captured after every item),
#: or in the main process (num_workers=0, or a main-process tail that is not one-to-one).
DIVERGENCE_CONFIGS = {
    "in_process": (0, {}, False),
    "workers": (2, {"stateful": False}, False),
    "workers_from_states": (2, {"max_items_between_captures": 1}, False),
    "main_process_tail": (2, {}, True),
}


class TestRestore(SuiteTestCase):
    def test_the_service_is_checkpointable(self) -> None:
        from torchdata.dataloader2.reading_service import CheckpointableReadingServiceInterface

        assert isinstance(MultiProcessingReadingService(), CheckpointableReadingServiceInterface)

    @parametrize("num_workers", [0, 2])
    def test_a_state_before_any_epoch_restores_to_a_fresh_start(self, num_workers: int) -> None:
        reference = self.make_dl(tiny(20), rs(num_workers))
        expected = [list(reference), list(reference)]
        dl = self.make_dl(tiny(20), rs(num_workers))
        state = dl.state_dict()
        assert state["reading_service_state"]["status"] == "idle"
        again = restored(self.make_dl, state, rs(num_workers))
        assert [list(again), list(again)] == expected

    def test_the_reading_service_state_is_plain_small_and_checkable(self) -> None:
        dl = self.make_dl(tiny(40), rs(2, stateful=False))  # (stateful, it adds a graph state per worker)
        it = iter(dl)
        take(it, 5)
        plain = dl.state_dict()["reading_service_state"]
        assert Checkpoint.from_plain(plain).delivered == 5
        assert len(pickle.dumps(plain)) < 2000

    def test_the_state_does_not_grow_with_the_position(self) -> None:
        for stateful in (False, True):  # with stateful restore, it holds a graph state per worker
            dl = self.make_dl(
                IterableWrapper(range(20_000)).sharding_filter().map(double), rs(2, stateful=stateful)
            )
            it = iter(dl)
            take(it, 3_000)
            early = len(pickle.dumps(dl.state_dict()["reading_service_state"]))
            take(it, 15_000)
            late = len(pickle.dumps(dl.state_dict()["reading_service_state"]))
            assert late - early <= 16, "only the digits of the counters may grow"

    @parametrize("shape", ["shuffle_after_sharding", "non_replicable_tail"])
    def test_the_main_process_keeps_no_digests_or_states_behind_what_it_may_need(self, shape: str) -> None:
        """Digests and graph states behind the user's position (or, when a main-process tail hides
        it, behind what was received) are dropped as they arrive: memory does not grow with k."""
        dl = self.make_dl(
            pipeline(shape, 6_000),
            rs(2, max_items_between_captures=16, batching=BatchingOptions(max_items=4)),
        )
        it = iter(dl)
        take(it, 4_000)
        window = credit_window_of(dl)  # the items a worker may have sent ahead of the user
        assert all(kept <= 2 * window for kept in kept_per_worker(dl))

    @parametrize("shape, per_item", [("uneven_filter", None), ("batch", 3)])
    def test_the_state_records_how_many_elements_each_sharding_filter_had_taken(
        self, shape: str, per_item: Any
    ) -> None:
        """At the user's position in each worker's stream: what elastic resume starts from."""
        dl = self.make_dl(pipeline(shape, 90), rs(2))
        take(iter(dl), 7)
        workers = dl.state_dict()["reading_service_state"]["workers"]
        delivered = [w["delivered"] for w in workers]
        if per_item is not None:  # batch(3): three elements per item
            expected = [per_item * d for d in delivered]
        else:  # filters drop elements: the position is that of the last delivered item's element
            kept = [[j for j, x in enumerate(range(i, 90, 2)) if x % 3 and x % 2 == 0] for i in range(2)]
            expected = [kept[i][d - 1] + 1 if d else 0 for i, d in enumerate(delivered)]
        assert [w["taken"] for w in workers] == expected and sum(delivered) == 7

    def test_another_num_workers_is_refused_before_any_process_starts(self) -> None:
        dl = self.make_dl(tiny(20), rs(2))
        take(iter(dl), 3)
        state = dl.state_dict()
        children = set(multiprocessing.active_children())
        with pytest.raises(
            IncompatibleCheckpointError,
            match="num_workers=2, this reading service has num_workers=4.*elastic=True",
        ):
            list(restored(self.make_dl, state, rs(4)))
        assert set(multiprocessing.active_children()) == children, "no worker was started for a misfit state"

    def test_another_pipeline_is_refused(self) -> None:
        dl = self.make_dl(tiny(20), rs(2))
        take(iter(dl), 3)
        state = moved_onto(dl.state_dict(), pipeline("batch", 20))
        with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
            list(restored(self.make_dl, state))

    @parametrize("num_workers", [0, 2])
    @parametrize("change", sorted(ARGUMENT_CHANGES))
    def test_other_arguments_are_refused_naming_the_datapipe_and_the_argument(
        self, change: str, num_workers: int
    ) -> None:
        build, old, new, message = ARGUMENT_CHANGES[change]
        dl = self.make_dl(build(old), rs(num_workers))
        it = iter(dl)
        take(it, 5)
        state = dl.state_dict()
        rest = list(it)
        children = set(multiprocessing.active_children())
        with pytest.raises(
            IncompatibleCheckpointError, match=f"other arguments of its DataPipes \\({message}\\)"
        ):
            list(restored(self.make_dl, moved_onto(state, build(new)), rs(num_workers)))
        assert set(multiprocessing.active_children()) == children, "no worker was started for a misfit state"
        assert list(restored(self.make_dl, moved_onto(state, build(old)), rs(num_workers))) == rest, (
            "the same pipeline, built again, restores"
        )

    def test_arguments_that_change_only_timing_may_change(self) -> None:
        build: Callable[[int], Any] = lambda k: tiny(40).prefetch(k)  # noqa: E731
        dl = self.make_dl(build(2), rs(2))
        it = iter(dl)
        take(it, 5)
        state = dl.state_dict()
        assert list(restored(self.make_dl, moved_onto(state, build(7)))) == list(it)

    def test_a_state_from_torchdatas_reading_service_is_refused(self) -> None:
        from torchdata.dataloader2 import SequentialReadingService

        dl = self.make_dl(tiny(20), SequentialReadingService(rs(2)))
        take(iter(dl), 3)
        state = dl.state_dict()  # SequentialReadingService pickles a list of states: bytes
        state["reading_service_state"] = b"\x80\x04]\x94."
        with pytest.raises(InvalidCheckpointError, match="is bytes"):
            list(restored(self.make_dl, state))

    @parametrize("num_workers", [0, 2])
    def test_a_pipeline_that_does_not_replay_is_detected(self, num_workers: int) -> None:
        datapipe = IterableWrapper(range(200)).sharding_filter().map(unseeded_noise)
        dl = self.make_dl(datapipe, rs(num_workers))
        take(iter(dl), 150)
        state = dl.state_dict()
        with pytest.raises(ReplayDivergenceError, match="not deterministic"):
            list(restored(self.make_dl, state, rs(num_workers)))
        unchecked = restored(self.make_dl, state, rs(num_workers, verify_replay=False))
        assert len(list(unchecked)) == 50

    def test_a_stateful_datapipe_of_ones_own_that_resets_in_iter_is_named_among_the_causes(self) -> None:
        build = lambda: ResetsItsCount(IterableWrapper(range(60)).sharding_filter())  # noqa: E731
        dl = self.make_dl(build(), rs(2, max_items_between_captures=1))
        take(iter(dl), 20)
        state = dl.state_dict()
        with pytest.raises(
            ReplayDivergenceError,
            match=r"a DataPipe of your own that restores a state \(test_restore\.ResetsItsCount\) but "
            r"does not continue, at its next __iter__, from the state load_state_dict\(\) loaded",
        ):
            list(restored(self.make_dl, state, rs(2, max_items_between_captures=1)))

    def test_a_hash_tokenizer_without_pythonhashseed_is_detected_and_named(self) -> None:
        """The classic divergence: ``hash()`` as tokenizer. Spawned workers take PYTHONHASHSEED from
        the environment: the run that saves fixes it, the one that restores does not."""
        texts = IterableWrapper([f"line {i} of some words" for i in range(40)])
        self.monkeypatch.setenv("PYTHONHASHSEED", "1")
        dl = self.make_dl(texts.sharding_filter().map(hash_tokens), rs(1, multiprocessing_context="spawn"))
        take(iter(dl), 10)
        state = dl.state_dict()
        dl.shutdown()
        self.monkeypatch.delenv("PYTHONHASHSEED")
        with pytest.raises(ReplayDivergenceError, match="PYTHONHASHSEED is not set, so hash\\(\\) of a str"):
            list(restored(self.make_dl, state, rs(1, multiprocessing_context="spawn")))

    @parametrize("k", [1, 2, 7, 20])
    @parametrize("config", sorted(DIVERGENCE_CONFIGS))
    def test_a_divergence_anywhere_before_the_position_is_detected(self, config: str, k: int) -> None:
        """The replay's running digest covers every item the user received: even the first item of
        the epoch, changed, is caught at every position k >= 1."""
        num_workers, options, main_tail = DIVERGENCE_CONFIGS[config]
        marker = self.tmp_path / "changed"

        def build() -> Any:
            dp = ChangesOnceMarked(200, str(marker)).sharding_filter().map(double)
            return NonReplicable(dp).map(double) if main_tail else dp

        dl = self.make_dl(build(), rs(num_workers, **options))
        head = take(iter(dl), k)
        state = dl.state_dict()
        same = DataLoader2.from_state(state, rs(num_workers, **options))
        self.make_dl.created.append(same)
        assert head + list(same) == list(self.make_dl(build(), rs(num_workers, **options))), (
            "unchanged: exact"
        )
        marker.touch()
        with pytest.raises(ReplayDivergenceError, match="not deterministic"):
            list(restored(self.make_dl, state, rs(num_workers, **options)))

    @parametrize("num_workers, k", [(2, 1), (2, 20), (0, 1), (0, 30)])
    def test_a_shard_order_no_seed_reproduces_is_detected_early_in_the_epoch(
        self, num_workers: int, k: int
    ) -> None:
        dl = self.make_dl(SystemRandomOrder(100_000).sharding_filter(), rs(num_workers))
        take(iter(dl), k)
        with pytest.raises(ReplayDivergenceError, match="not deterministic"):
            list(restored(self.make_dl, dl.state_dict(), rs(num_workers)))

    def test_a_checkpoint_always_restores_from_a_state_strictly_behind_the_user(self) -> None:
        """With a state captured after every item, each checkpoint still picks one behind the user's
        position, so that a restore replays (and checks) at least one item."""
        dl = self.make_dl(pipeline("stateful_source", 200), rs(2, max_items_between_captures=1))
        it = iter(dl)
        for _ in range(40):
            next(it)
            for worker in dl.state_dict()["reading_service_state"]["workers"]:
                if worker["state"] is not None:
                    assert worker["state"]["position"] < worker["delivered"]
                assert (worker["digest"] is None) == (worker["delivered"] == 0)

    @parametrize("k", [1, 4, 9, 30])
    def test_a_wrong_state_is_caught_even_when_captured_at_the_users_position(self, k: int) -> None:
        """Defence in depth: a deliberately broken DataPipe state (it resumes one item too late) ends
        in ReplayDivergenceError, not in wrong data, although a state was captured after every item.
        (At k=1 no worker has a state behind its position: the restore replays from the start.)"""
        build = lambda: OffByOneState(300).sharding_filter().map(double)  # noqa: E731
        reference = list(self.make_dl(build(), rs(2)))
        dl = self.make_dl(build(), rs(2, max_items_between_captures=1))
        take(iter(dl), k)
        again = restored(self.make_dl, dl.state_dict(), rs(2, max_items_between_captures=1))
        if k == 1:
            assert list(again) == reference[k:]
            return
        with pytest.raises(ReplayDivergenceError, match="not deterministic"):
            list(again)

    def test_load_state_dict_after_iteration_started_is_refused(self) -> None:
        dl = self.make_dl(tiny(10), rs(2))
        take(iter(dl), 2)
        with pytest.raises(RuntimeError, match="load_state_dict"):
            dl.load_state_dict(dl.state_dict())

    def test_load_state_dict_keeps_the_pipeline_the_loader_was_built_with(self) -> None:
        """``torchdata_snapshot.load_state_dict`` runs the loader's own pipeline, where
        ``DataLoader2.load_state_dict`` runs the one pickled in the state (here another one)."""
        dl = self.make_dl(tiny(30), rs(2))
        it = iter(dl)
        take(it, 7)
        state = moved_onto(dl.state_dict(), tiny(30).batch(2))  # pickled: another pipeline
        rest = list(it)
        plain = self.make_dl(tiny(30), rs(2), seed=None)
        plain.load_state_dict(state)
        with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
            iter(plain)
        ours = self.make_dl(tiny(30), rs(2), seed=None)
        load_state_dict(ours, state)
        assert ours.state_dict() is state, "state_dict() before iter() is the state loaded"
        assert list(ours) == rest
        assert len(list(ours)) == 30, "then the next epoch"

    @parametrize("num_workers", [0, 2])
    def test_load_state_dict_refuses_another_pipeline_at_the_call(self, num_workers: int) -> None:
        dl = self.make_dl(tiny(30).batch(4), rs(num_workers))
        take(iter(dl), 3)
        state = dl.state_dict()
        children = set(multiprocessing.active_children())
        with pytest.raises(IncompatibleCheckpointError, match="batch_size was 4 in the checkpoint, is 5 now"):
            load_state_dict(self.make_dl(tiny(30).batch(5), rs(num_workers)), state)
        with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
            load_state_dict(self.make_dl(tiny(30), rs(num_workers)), state)
        assert set(multiprocessing.active_children()) == children, "no worker was started"

    def test_load_state_dict_under_a_sequential_reading_service_checks_at_the_first_iter(self) -> None:
        from torchdata.dataloader2 import SequentialReadingService

        dl = self.make_dl(tiny(30), SequentialReadingService(rs(2)))
        it = iter(dl)
        take(it, 7)
        state = dl.state_dict()
        rest = list(it)
        again = self.make_dl(tiny(30), SequentialReadingService(rs(2)), seed=None)
        load_state_dict(again, state)
        assert list(again) == rest
        other = self.make_dl(tiny(30).batch(5), SequentialReadingService(rs(2)), seed=None)
        load_state_dict(other, state)
        with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
            iter(other)

    def test_load_state_dict_says_what_it_cannot_load_into(self) -> None:
        dl = self.make_dl(tiny(10), rs(2))
        take(iter(dl), 2)
        state = dl.state_dict()
        with pytest.raises(ReadingServiceError, match="before the DataLoader2 is first iterated"):
            load_state_dict(dl, state)
        with pytest.raises(ValueError, match="built without a datapipe.*DataLoader2.from_state"):
            load_state_dict(DataLoader2(None, reading_service=rs(2)), state)
        with pytest.raises(TypeError, match="restores into torchdata_snapshot.MultiProcessingReadingService"):
            load_state_dict(self.make_dl(tiny(10), None), state)
        with pytest.raises(
            InvalidCheckpointError, match="not a DataLoader2 state: the dict has no 'reading_service_state'"
        ):
            load_state_dict(self.make_dl(tiny(10), rs(2)), {"serialized_datapipe": b""})
        with pytest.raises(InvalidCheckpointError, match="not a DataLoader2 state .* not a list"):
            load_state_dict(self.make_dl(tiny(10), rs(2)), [])  # type: ignore[arg-type]
        with pytest.raises(InvalidCheckpointError, match="format is None"):
            load_state_dict(
                self.make_dl(tiny(10), rs(2)), {**state, "reading_service_state": {"nonsense": 1}}
            )

    def test_state_dict_after_shutdown_is_refused(self) -> None:
        from torchdata_snapshot import ReadingServiceClosedError

        dl = self.make_dl(tiny(10), rs(2))
        take(iter(dl), 2)
        dl.shutdown()
        with pytest.raises(ReadingServiceClosedError, match="shut down"):
            dl.state_dict()

    def test_no_runtime_attribute_shadows_a_method(self) -> None:
        # A runtime attribute named like one of torchdata's methods (``_resume``, ``_pause``, ...)
        # would silently replace it: DataLoader2 calls those by name.
        dl = self.make_dl(tiny(10), rs(2))
        take(iter(dl), 3)
        again = restored(self.make_dl, dl.state_dict())
        take(iter(again), 1)
        for service in (dl.reading_service, again.reading_service):
            for name in vars(service):
                assert not callable(getattr(type(service), name, None)), f"attribute {name} shadows a method"

    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    @parametrize(
        "make_item",
        [subtest(conj_imag_item, name="conj_imag"), subtest(padded_arrays_item, name="padded_arrays")],
    )
    def test_items_of_any_layout_are_delivered_and_restore_exactly(
        self, context: str, make_item: Any
    ) -> None:
        """A 1-element negative view killed the worker; arrays with padding made every exact restore
        a ``ReplayDivergenceError`` (the padding differs between the run and the replay)."""
        n, k = 24, 9
        dl = self.make_dl(
            IterableWrapper(range(n)).sharding_filter().map(make_item), rs(2, multiprocessing_context=context)
        )
        epoch = list(dl)
        assert [item["i"] for item in epoch] == list(range(n))
        head = take(iter(dl), k)
        restored = DataLoader2.from_state(dl.state_dict(), rs(2, multiprocessing_context=context))
        try:
            rest = list(restored)
        finally:
            restored.shutdown()
        assert len(head + rest) == n
        assert all(same_values(a, b) for a, b in zip(head + rest, epoch))

    @parametrize("num_workers", [0, 2])
    def test_items_that_hold_themselves_are_delivered_and_restore_exactly(self, num_workers: int) -> None:
        """An item that holds itself made the digest recurse until the worker died (WorkerDiedError
        naming no cause; RecursionError with num_workers=0), and one of parent pointers took
        exponential time: each is walked once per path, as pickle's memo does."""
        n, k = 10, 4
        dl = self.make_dl(
            IterableWrapper(range(n)).sharding_filter().map(holding_itself_item), rs(num_workers)
        )
        epoch = list(dl)
        assert [item["i"] for item in epoch] == list(range(n))
        head = take(iter(dl), k)
        restored = DataLoader2.from_state(dl.state_dict(), rs(num_workers))
        try:
            rest = list(restored)
        finally:
            restored.shutdown()
        assert len(head + rest) == n
        assert all(same_holding_itself(a, b) for a, b in zip(epoch, head + rest))


instantiate_parametrized_tests(TestRestore)


if __name__ == "__main__":
    unittest.main()
