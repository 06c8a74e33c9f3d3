"""Elastic resume (docs: elastic.rst): a checkpoint resumed with another ``num_workers`` and
``elastic=True`` delivers, in the rest of its epoch, every element the user had not received,
exactly once, in an order fixed by the checkpoint and the new configuration; the next epoch is
the one a fresh run with the new configuration would give. Each resume runs in a fresh process.
"""

from __future__ import annotations

import functools
import multiprocessing
import re
import unittest
from collections import Counter
from dataclasses import replace
from typing import Any, Dict, List

import pytest
from contract import (
    FULL_MATRIX,
    POSITIONS,
    Config,
    Resumer,
    ResumeTask,
    case_name,
    check_contract,
    encode_state,
    matrix,
    reference,
    resolve_positions,
    take_states,
)
from draws import SeededDraw, examples
from elastic_pipelines import ElasticDoubling
from faults import kill_once_at_reset, restarts_logged
from pipelines import ELASTIC_DECLARED, double, moved_onto, pipeline, rs, split, take, tiny
from suite_case import ResumingTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import torchdata_snapshot
from torchdata_snapshot import IncompatibleCheckpointError, register_elastic
from torchdata_snapshot.elastic.resume import elastic_refusal

#: Pipeline shapes whose epochs resume elastically (see pipelines.py).
ELASTIC_SHAPES = [
    "shuffle_before_sharding",
    "batch",
    "uneven_filter",
    "global_rng",
    "map_filter_batch",
    # One DataPipe yields several items per element after the sharding filter (an expander):
    "unbatch",
    "unbatch_batch",
    "lines_after_sharding",
    "webdataset_after_sharding",
]

ELASTIC = (("elastic", True),)


def elements(items: List[Any]) -> List[Any]:
    """The epoch's elements the items carry: a batch carries several, ``global_rng``'s tuples
    carry theirs first (the random numbers beside it are the worker's own)."""
    found: List[Any] = []
    for item in items:
        if isinstance(item, list):
            found.extend(elements(item))
        else:
            found.append(item[0] if isinstance(item, tuple) else item)
    return found


def resume_elastically(
    resumer: Resumer, config: Config, k: int, num_workers: int, via: str = "from_state"
) -> Dict[str, Any]:
    """Take ``state_dict()`` after ``k`` items of ``config``'s epoch; resume it twice in fresh
    processes with ``num_workers`` and ``elastic=True`` (through ``via``); check what the
    contract promises."""
    run, [(_, state)] = take_states(config, [k])
    target = replace(config, num_workers=num_workers)
    task = ResumeTask(target, encode_state(state, "pickle"), via=via, options=ELASTIC)
    first, second = resumer.run(task), resumer.run(task)
    assert first["epochs"] == second["epochs"], "two resumes of one checkpoint must give the same sequence"
    epoch = run[config.epoch]
    before, after = epoch[:k], first["epochs"][0]
    assert Counter(elements(before + after)) == Counter(elements(epoch)), (
        f"{config} resumed at {k} with num_workers={num_workers}: the epoch's elements are not each "
        "delivered exactly once"
    )
    assert len(set(elements(epoch))) == len(elements(epoch)), "the test needs distinct elements"
    assert first["epochs"][1] == list(reference(target, config.epoch + 2)[config.epoch + 1]), (
        "the next epoch must be the one a fresh run with the new num_workers gives"
    )
    if num_workers == config.num_workers:
        assert after == epoch[k:], "the same num_workers resumes exactly"
    return first


def _expanded_twice() -> Any:
    return IterableWrapper(range(40)).sharding_filter().flatmap(split).flatmap(split)


def _batched_then_expanded() -> Any:
    return IterableWrapper(range(40)).sharding_filter().batch(2).unbatch()


def _webdataset_without_expander() -> Any:
    return (
        IterableWrapper([(f"s{i // 2}.{'ab'[i % 2]}", i) for i in range(40)]).sharding_filter().webdataset()
    )


class ElasticDoublingSubclass(ElasticDoubling):
    """Not declared: it inherits its base's declaration, which covers the base only."""


class TestElastic(ResumingTestCase):
    def restore(self, state: Dict[str, Any], reading_service: Any) -> DataLoader2:
        """``DataLoader2.from_state``, shut down after the test."""
        dl = DataLoader2.from_state(state, reading_service)
        self.addCleanup(dl.shutdown)
        return dl

    @examples()
    def test_any_elastic_resume_delivers_each_remaining_element_exactly_once(self, draw: SeededDraw) -> None:
        shape, old, new = draw.choice(ELASTIC_SHAPES), draw.integer(1, 4), draw.integer(1, 4)
        prefetch, n, epoch = draw.choice([0, 1, 10]), draw.integer(0, 60), draw.integer(0, 1)
        options = (("stateful", draw.boolean()), ("max_items_between_captures", 3))
        config = Config(shape, old, prefetch, prefetch, n=n, epoch=epoch, rs_options=options)
        length = len(reference(config, epoch + 3)[epoch])
        resume_elastically(self.resumer, config, draw.integer(0, length), new)

    @parametrize("via", ["from_state", "load_state_dict"])
    @parametrize("old, new", [(1, 4), (4, 1), (2, 3), (3, 2)])
    def test_more_and_fewer_workers_at_the_middle_of_an_epoch(self, old: int, new: int, via: str) -> None:
        config = Config("map_filter_batch", old, n=200, epoch=1)
        length = len(reference(config, 4)[1])
        resume_elastically(self.resumer, config, length // 2, new, via)

    def test_a_checkpoint_of_an_elastic_epoch_resumes_exactly_and_elastically_again(self) -> None:
        """Two elastic resumes in one epoch (2 -> 3 -> 1 workers), then an exact one (1 -> 1) from a
        graph state captured in the elastic epoch: still every element exactly once."""
        options = (("stateful", True), ("max_items_between_captures", 2))
        config = Config("map_filter_batch", 2, n=300, epoch=0, rs_options=options)
        run, [(_, first_state)] = take_states(config, [10])
        got, state = list(run[0][:10]), encode_state(first_state, "pickle")
        for num_workers, more in ((3, 12), (1, 7), (1, 5)):
            task = ResumeTask(replace(config, num_workers=num_workers), state, options=ELASTIC, take=more)
            result = self.resumer.run(task)
            got += result["taken"]
            state = result["state"]
        rest = self.resumer.run(ResumeTask(replace(config, num_workers=1), state, options=ELASTIC))
        got += rest["epochs"][0]
        assert Counter(elements(got)) == Counter(elements(run[0]))

    @parametrize(
        "shape, culprit",
        [
            ("shuffle_after_sharding", "Shuffler"),
            ("sharding_under_cycle", "Cycler"),
            ("dispatch", "sharding_round_robin_dispatch"),
            ("non_replicable_tail", r"not known to hand on one item per item: pipelines\.NonReplicable \("),
        ],
    )
    def test_graphs_that_would_lose_or_repeat_elements_are_refused_naming_why(
        self, shape: str, culprit: str
    ) -> None:
        dl = self.make_dl(pipeline(shape, 40), rs(2))
        take(iter(dl), 5)
        state = dl.state_dict()
        children = set(multiprocessing.active_children())
        with pytest.raises(IncompatibleCheckpointError, match=culprit):
            iter(self.restore(state, rs(3, elastic=True)))
        assert set(multiprocessing.active_children()) == children, "nothing starts for a refused resume"

    @parametrize(
        "make, culprit",
        [
            (
                _expanded_twice,
                r"FlatMapper.* yields several items per element after .*FlatMapper.*, which does too",
            ),
            (_batched_then_expanded, r"Batcher.* runs between sharding_filter and .*UnBatcher"),
            (_webdataset_without_expander, r"WebDataset.* runs after sharding_filter"),
        ],
    )
    def test_expanders_that_could_not_skip_what_the_user_had_are_refused_naming_why(
        self, make: Any, culprit: str
    ) -> None:
        """One expander after the sharding filter, taking the elements it yields one at a time: a
        second one, a batch before it, or a DataPipe that holds an item without one is refused."""
        assert re.search(culprit, elastic_refusal(make()) or ""), elastic_refusal(make())

    @parametrize("k", [1, 3])
    def test_a_subclass_of_map_that_holds_an_item_is_refused_naming_it(self, k: int) -> None:
        """A ``Mapper`` subclass handing on its items in swapped pairs holds one across its outputs:
        resumed 2 -> 3 workers after an odd number of items, the element it held would be lost."""
        dl = self.make_dl(pipeline("swapped_pairs_after_sharding", 40), rs(2))
        take(iter(dl), k)
        state = dl.state_dict()
        children = set(multiprocessing.active_children())
        culprit = r"pipelines\.SwappedPairs runs after sharding_filter"
        with pytest.raises(IncompatibleCheckpointError, match=culprit):
            iter(self.restore(state, rs(3, elastic=True)))
        assert set(multiprocessing.active_children()) == children, "nothing starts for a refused resume"

    @parametrize("k", [1, 3])
    def test_a_subclass_declared_with_register_elastic_resumes_elastically(self, k: int) -> None:
        resume_elastically(self.resumer, Config("declared_elastic_subclass", 2, n=40, epoch=0), k, 3)

    def test_a_declaration_covers_its_class_and_not_its_subclasses(self) -> None:
        def graph(kind: type) -> Any:
            return kind(IterableWrapper(range(8)).sharding_filter())

        assert register_elastic(ElasticDoubling) is ElasticDoubling, "returns the class: a class decorator"
        assert elastic_refusal(graph(ElasticDoubling)) is None
        refusal = elastic_refusal(graph(ElasticDoublingSubclass))
        assert refusal is not None and "ElasticDoublingSubclass runs after sharding_filter" in refusal
        with pytest.raises(TypeError, match="IterDataPipe class"):
            register_elastic(double)  # type: ignore[type-var]

    def test_without_the_opt_in_another_num_workers_is_refused_naming_it(self) -> None:
        dl = self.make_dl(tiny(20), rs(2))
        take(iter(dl), 3)
        with pytest.raises(IncompatibleCheckpointError, match=r"elastic=True\) resumes the epoch"):
            iter(self.restore(dl.state_dict(), rs(3)))

    def test_an_elastic_resume_on_other_arguments_is_refused_naming_them(self) -> None:
        dl = self.make_dl(pipeline("batch", 40), rs(2))  # batch(3)
        take(iter(dl), 5)
        state = moved_onto(dl.state_dict(), IterableWrapper(range(40)).shuffle().sharding_filter().batch(4))
        with pytest.raises(
            IncompatibleCheckpointError, match="BatcherIterDataPipe: batch_size was 3 in the checkpoint, is 4"
        ):
            iter(self.restore(state, rs(3, elastic=True)))

    @parametrize(
        "old, new, why",
        [(0, 2, "taken with num_workers=0"), (2, 0, r"needs worker processes \(num_workers >= 1\)")],
    )
    def test_num_workers_0_does_not_resume_elastically(self, old: int, new: int, why: str) -> None:
        dl = self.make_dl(tiny(20), rs(old))
        take(iter(dl), 3)
        with pytest.raises(IncompatibleCheckpointError, match=why):
            iter(self.restore(dl.state_dict(), rs(new, elastic=True)))

    def test_a_finished_epoch_goes_on_with_the_next_one_of_the_new_configuration(self) -> None:
        dl = self.make_dl(tiny(20), rs(2))
        list(dl)
        resumed = self.restore(dl.state_dict(), rs(3, elastic=True))
        fresh = self.make_dl(tiny(20), rs(3))
        list(fresh)
        assert list(resumed) == list(fresh)

    def test_a_worker_replaced_in_an_elastic_epoch_keeps_its_elements(self) -> None:
        """A worker killed while resetting to the elastic epoch is replaced (``restart_dead_workers``)
        and reset to the elastic epoch too: the epoch's elements are still each delivered once."""
        epoch = list(self.make_dl(pipeline("map_filter_batch", 300), rs(2)))
        dl = self.make_dl(pipeline("map_filter_batch", 300), rs(2))
        before = take(iter(dl), 20)
        state = dl.state_dict()
        marker = self.tmp_path / "kill"
        marker.touch()
        reset_fn = functools.partial(kill_once_at_reset, str(marker))
        with restarts_logged("died .*restarting it"):
            after = list(
                self.restore(state, rs(3, elastic=True, restart_dead_workers=1, worker_reset_fn=reset_fn))
            )
        assert not marker.exists(), "no worker was killed"
        assert Counter(elements(before + after)) == Counter(elements(epoch))

    def test_gather_elastic_state_refuses_what_is_not_a_state_dict_of_ours(self) -> None:
        from torchdata_snapshot import InvalidCheckpointError, gather_elastic_state

        for not_ours in ({}, {"reading_service_state": b"another reading service's bytes"}):
            with pytest.raises(InvalidCheckpointError, match="not a DataLoader2.state_dict"):
                gather_elastic_state(not_ours)
        with pytest.raises(InvalidCheckpointError, match="not a checkpoint of this reading service"):
            gather_elastic_state({"reading_service_state": {"a": 1}})

    def test_new_workers_start_the_pre_sharding_part_from_an_old_workers_captured_state(self) -> None:
        """An elastic resume does not run the epoch's pre-sharding part from its start in every new
        worker when the old workers captured graph states: they load the latest one that lies
        before the first remaining element."""
        n, k = 20_000, 5_000
        epoch = list(self.make_dl(pipeline("shuffle_before_sharding", n), rs(2)))
        dl = self.make_dl(pipeline("shuffle_before_sharding", n), rs(2, max_items_between_captures=8))
        before = take(iter(dl), k)
        resumed = self.restore(dl.state_dict(), rs(3, elastic=True, max_items_between_captures=8))
        it = iter(resumed)
        after = [next(it)]
        source_yields = [
            count
            for snapshot in resumed.reading_service.snapshot()
            for key, count in snapshot.datapipe_yields.items()
            if key.endswith("IterableWrapper")
        ]
        # From the epoch's start, a worker reads every element before the first remaining one (k of
        # them at least, 15,000 here with the shuffle's buffer); from a head start, what it produced
        # ahead under credit (up to 512 tiny items, about 3 source elements each with 3 workers).
        assert len(source_yields) == 3 and max(source_yields) < k, (
            f"the new workers read {source_yields} source elements: they started near the position "
            f"({k} elements delivered), not at the epoch's start"
        )
        after += list(it)
        assert Counter(before + after) == Counter(epoch)

    @parametrize("declared_config", matrix(sorted(ELASTIC_DECLARED), FULL_MATRIX), name_fn=case_name)
    def test_a_subclass_declared_elastic_resumes_exactly_over_the_contracts_matrix(
        self, declared_config: Config
    ) -> None:
        """The exact-resume contract (test_contract.py) for the shapes only elastic resume can build:
        with the same layout, a declared subclass restores as any other DataPipe does."""
        check_contract(self.resumer, declared_config, resolve_positions(declared_config, POSITIONS))

    @parametrize("name", ["gather_elastic_state", "register_elastic"])
    def test_the_elastic_names_are_exported_and_documented(self, name: str) -> None:
        assert name in torchdata_snapshot.__all__
        doc = getattr(torchdata_snapshot, name).__doc__
        assert doc and doc.strip(), f"{name} has no docstring"


instantiate_parametrized_tests(TestElastic)


if __name__ == "__main__":
    unittest.main()
