"""Restore planning, without processes: which epoch a restored service resumes, and how."""

from __future__ import annotations

import unittest
from dataclasses import replace
from typing import Any
from unittest import TestCase

import pytest
from pipelines import double, split
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torch.utils.data.graph_settings import apply_sharding
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._errors import IncompatibleCheckpointError, InvalidCheckpointError
from torchdata_snapshot.checkpoint.format import Checkpoint, WorkerPosition
from torchdata_snapshot.checkpoint.identity import graph_identity
from torchdata_snapshot.checkpoint.restore_plan import (
    PendingRestore,
    plan_restore,
    rewind,
    sharding_of,
)
from torchdata_snapshot.checkpoint.seeds import rank_seed_state, seed_state
from torchdata_snapshot.core.messages import ElasticEpoch, Level

BLOB = b"\x80\x05}."


def sharded() -> Any:
    """An elastic graph: map after a single sharding filter."""
    return IterableWrapper(range(20)).shuffle().sharding_filter().map(double)


def in_epoch(datapipe: Any, **changes: Any) -> Checkpoint:
    """A state taken with 2 workers after 5 items of epoch 3 of ``datapipe``."""
    fields: Any = dict(
        num_workers=2,
        graph=graph_identity(datapipe),
        epoch=3,
        status="in_epoch",
        seed=seed_state(SeedGenerator(1)),
        delivered=5,
        workers=(
            WorkerPosition(3, "00ff00ff00ff00ff", (2, BLOB, "0123456789abcdef"), 3),
            WorkerPosition(2, None, None, 2),
        ),
        next_worker=1,
        sharding=(1, 0),
    )
    fields.update(changes)
    return Checkpoint(**fields)


def plan(state: Checkpoint, datapipe: Any, num_workers: int, elastic: bool = False) -> Any:
    return plan_restore(
        state, datapipe, graph_identity(datapipe), sharding_of(datapipe), num_workers, elastic
    )


class TestRestorePlan(TestCase):
    def test_a_state_taken_outside_an_epoch_resumes_nothing(self) -> None:
        dp = sharded()
        idle = Checkpoint(2, graph_identity(dp), epoch=-1, workers=(WorkerPosition(),) * 2)
        assert plan(idle, dp, 2) is None
        assert plan(replace(idle, epoch=4, status="finished"), dp, 2) is None
        assert plan(idle, dp, 3, elastic=True) is None, "an idle state fits any layout of its graph"

    def test_a_state_taken_in_an_epoch_resumes_it_exactly_with_the_same_layout(self) -> None:
        dp = sharded()
        state = in_epoch(dp)
        assert plan(state, dp, 2) == PendingRestore(state)
        assert plan(state, dp, 2, elastic=True) == PendingRestore(state), "same layout: exact, not elastic"

    def test_a_state_of_another_layout_or_graph_is_refused_before_anything_starts(self) -> None:
        dp = sharded()
        with pytest.raises(
            IncompatibleCheckpointError, match="num_workers=2, this reading service has num_workers=3"
        ):
            plan(in_epoch(dp), dp, 3)
        other = IterableWrapper(range(20)).sharding_filter()
        with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
            plan(in_epoch(dp), other, 2)
        with pytest.raises(IncompatibleCheckpointError, match="another pipeline"):
            plan(in_epoch(dp), other, 3, elastic=True)

    def test_another_ranks_state_resumes_this_rank_only_when_gathered(self) -> None:
        dp = sharded()
        apply_sharding(dp, 2, 1, SHARDING_PRIORITIES.DISTRIBUTED)  # this is rank 1 of 2
        rank0 = in_epoch(dp, sharding=(2, 0))
        rank1 = replace(rank0, sharding=(2, 1), delivered=4, workers=(WorkerPosition(2, taken=2),) * 2)
        for elastic in (False, True):
            with pytest.raises(IncompatibleCheckpointError, match="taken on rank 0 of 2, this is rank 1"):
                plan(rank0, dp, 2, elastic)
            pending = plan(replace(rank0, ranks=(rank0, rank1)), dp, 2, elastic)
            assert pending == PendingRestore(replace(rank1, ranks=(rank0, rank1))), (
                "rank 1's own state, exactly"
            )

    def test_an_elastic_plan_deals_what_remains_over_the_new_workers(self) -> None:
        dp = sharded()
        pending = plan(in_epoch(dp), dp, 3, elastic=True)
        assert pending.checkpoint == Checkpoint(
            num_workers=3,
            graph=graph_identity(dp),
            epoch=3,
            status="in_epoch",
            seed=seed_state(SeedGenerator(1)),
            workers=(WorkerPosition(taken=0),) * 3,
            sharding=(1, 0),
            remaining=(Level((3, 2), (0, 0)),),
        )
        assert pending.elastic == ElasticEpoch((Level((3, 2), (0, 0)),), head_states=((0, BLOB),))

    def test_an_elastic_plan_adds_a_level_and_takes_this_ranks_seeds(self) -> None:
        dp = sharded()
        earlier = Level((1, 1, 1, 1), (0, 0, 0, 0))
        rank1 = in_epoch(dp, sharding=(2, 1), remaining=(earlier,))
        rank0 = replace(
            rank1,
            sharding=(2, 0),
            delivered=6,
            workers=(WorkerPosition(3, taken=4), WorkerPosition(3, taken=4)),
        )
        state = replace(rank1, ranks=(rank0, rank1))
        pending = plan(state, dp, 1, elastic=True)
        assert pending.checkpoint.remaining == (earlier, Level((4, 4, 3, 2), (0, 0, 0, 0)))
        assert pending.checkpoint.seed == state.seed, "one rank now: rank 0's seeds are the shared stream's"
        assert pending.elastic.head_states == ((2, BLOB),), "the instance of rank 1's first worker"
        apply_sharding(dp, 2, 1, SHARDING_PRIORITIES.DISTRIBUTED)  # as DistributedReadingService does
        assert plan(state, dp, 3, elastic=True).checkpoint.seed == rank_seed_state(state.seed, 1)

    def test_through_an_expander_the_last_element_each_worker_took_remains_with_what_it_delivered(
        self,
    ) -> None:
        dp = IterableWrapper(range(20)).shuffle().sharding_filter().flatmap(split)
        state = in_epoch(
            dp, workers=(WorkerPosition(3, taken=2, partial=1), WorkerPosition(2, taken=1, partial=2))
        )
        pending = plan(state, dp, 3, elastic=True)
        assert pending.elastic.levels == (Level((1, 0), (1, 2)),), (
            "element 1 of worker 0 and 0 of worker 1 remain"
        )
        untaken = in_epoch(
            dp, workers=(WorkerPosition(0, taken=0, partial=None), WorkerPosition(2, taken=1, partial=0))
        )
        assert plan(untaken, dp, 1, elastic=True).elastic.levels == (Level((0, 0), (0, 0)),)

    def test_an_elastic_plan_through_an_expander_needs_the_partial_counts(self) -> None:
        """A state of format version 4 (or of a graph without an expander) does not tell how far into
        their elements the workers were."""
        dp = IterableWrapper(range(20)).shuffle().sharding_filter().flatmap(split)
        with pytest.raises(IncompatibleCheckpointError, match="does not record how far into their elements"):
            plan(in_epoch(dp), dp, 3, elastic=True)

    def test_an_elastic_plan_needs_workers_and_an_elastic_graph(self) -> None:
        dp = sharded()
        with pytest.raises(IncompatibleCheckpointError, match=r"needs worker processes \(num_workers >= 1\)"):
            plan(in_epoch(dp), dp, 0, elastic=True)
        held = IterableWrapper(range(20)).sharding_filter().shuffle()
        with pytest.raises(IncompatibleCheckpointError, match="runs after sharding_filter"):
            plan(in_epoch(held), held, 3, elastic=True)

    def test_an_exact_restore_of_an_elastic_epoch_keeps_its_levels_without_head_starts(self) -> None:
        dp = sharded()
        level = Level((3, 2), (0, 1))
        state = in_epoch(dp, remaining=(level,))
        assert plan(state, dp, 2) == PendingRestore(state, ElasticEpoch((level,)))
        zero = in_epoch(dp, num_workers=0, workers=(), replay_in_main=True, next_worker=0, remaining=(level,))
        with pytest.raises(InvalidCheckpointError, match="num_workers=0 cannot hold the levels"):
            plan(zero, dp, 0)

    def test_rewind_puts_the_generator_back_to_where_the_resumed_epoch_started(self) -> None:
        dp = sharded()
        pending = PendingRestore(in_epoch(dp))
        generator = SeedGenerator(7)
        assert rewind(pending, generator) is pending
        assert seed_state(generator) == pending.checkpoint.seed
        assert rewind(None, generator) is None


if __name__ == "__main__":
    unittest.main()
