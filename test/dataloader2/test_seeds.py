"""SeedGenerator state as plain data: exact round trip, in place, validated."""

from __future__ import annotations

import copy
import json
import re
import unittest
from unittest import TestCase

import pytest
import torch
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._errors import InvalidCheckpointError
from torchdata_snapshot.checkpoint.seeds import (
    check_seed_state,
    drawn_by_unseeded_dataloader2,
    load_seed_state,
    rank_seed_state,
    seed_state,
)


def advanced(seed: int) -> SeedGenerator:
    g = SeedGenerator(seed)
    g.generate_seed()  # leaves a cached draw in the worker engine
    g.generate_shared_seed()
    g.spawn(3, inplace=True)
    return g


def draws(g: SeedGenerator) -> list:
    return [g.generate_seed(), g.generate_shared_seed(), g.spawn(1).generate_seed(), g.generate_seed()]


class TestSeeds(TestCase):
    def test_the_state_is_plain_json_data(self) -> None:
        state = seed_state(advanced(5))
        assert json.loads(json.dumps(state)) == state

    def test_loading_the_state_continues_the_same_draws_in_place(self) -> None:
        original = advanced(5)
        target = SeedGenerator(99)
        same_object = target
        load_seed_state(target, seed_state(original))
        assert target is same_object
        assert draws(target) == draws(original)

    def test_the_state_does_not_alias_the_generator(self) -> None:
        g = advanced(5)
        state = seed_state(g)
        frozen = copy.deepcopy(state)
        g.generate_seed()
        assert state == frozen

    @parametrize(
        "corrupt, match",
        [
            (lambda s: s.pop("worker"), "keys 'shared' and 'worker'"),
            (lambda s: s["shared"].pop("ctr"), "unexpected fields"),
            (
                lambda s: s["shared"].__setitem__("ctr", [1, 2]),
                "shared.ctr must be a list of 4 32-bit integers",
            ),
            (
                lambda s: s["worker"].__setitem__("seed", ["a", 0]),
                "worker.seed must be a list of 2 32-bit integers",
            ),
            (lambda s: s["worker"].__setitem__("generated", [True, 0, 0, 0]), "worker.generated"),
            (lambda s: s["shared"].__setitem__("seed", [2**40, 0]), "shared.seed must be a list of 2 32-bit"),
            (
                lambda s: s["shared"].__setitem__("ctr", [0, -2, 0, 0]),
                "shared.ctr must be a list of 4 32-bit",
            ),
        ],
        name_fn=lambda corrupt, match: re.sub(r"\W+", "_", match).strip("_"),
    )
    def test_invalid_states_are_refused(self, corrupt, match: str) -> None:  # type: ignore[no-untyped-def]
        state = seed_state(advanced(5))
        corrupt(state)
        with pytest.raises(InvalidCheckpointError, match=match):
            check_seed_state(state)
        with pytest.raises(InvalidCheckpointError):
            load_seed_state(SeedGenerator(1), state)

    def test_a_ranks_seeds_derive_from_the_shared_stream_as_distributed_reading_service_does(self) -> None:
        rank_0 = SeedGenerator(1234).spawn(0, inplace=True)  # DistributedReadingService, rank 0
        rank_2 = SeedGenerator(1234).spawn(2, inplace=True)
        assert rank_seed_state(seed_state(rank_0), 2) == seed_state(rank_2)
        assert rank_seed_state(seed_state(rank_2), 2) == seed_state(rank_2), "a rank's own state is unchanged"

    def test_the_generator_an_unseeded_dataloader2_draws_at_iter_is_recognised(self) -> None:
        torch.manual_seed(11)
        generator = SeedGenerator(0)
        generator.seed()  # what DataLoader2.__iter__ does without dl.seed()
        assert drawn_by_unseeded_dataloader2(generator)

    def test_a_seeded_generator_is_not_taken_for_a_draw(self) -> None:
        torch.manual_seed(11)
        assert not drawn_by_unseeded_dataloader2(SeedGenerator(11))
        assert not drawn_by_unseeded_dataloader2(advanced(3))

    def test_a_draw_is_not_recognised_once_the_global_rng_moved(self) -> None:
        torch.manual_seed(11)
        generator = SeedGenerator()
        torch.rand(1)
        assert not drawn_by_unseeded_dataloader2(generator)

    def test_a_draw_reseeded_by_a_distributed_reading_service_in_front_is_recognised(self) -> None:
        torch.manual_seed(11)
        generator = SeedGenerator()
        # DistributedReadingService.initialize_iteration: rank 0's shared seed, then the rank's spawn
        generator.seed(generator.generate_shared_seed())
        generator.spawn(1, inplace=True)
        generator.generate_shared_seed()  # set_graph_random_seed() seeding a shuffle
        assert drawn_by_unseeded_dataloader2(generator)

    def test_a_seeded_generator_reseeded_by_a_distributed_reading_service_is_not_taken_for_a_draw(
        self,
    ) -> None:
        torch.manual_seed(11)
        generator = SeedGenerator(11)
        generator.seed(generator.generate_shared_seed())
        assert not drawn_by_unseeded_dataloader2(generator)

    def test_recognising_a_draw_leaves_the_global_rng_alone(self) -> None:
        torch.manual_seed(11)
        before = torch.get_rng_state()
        drawn_by_unseeded_dataloader2(SeedGenerator(1))
        assert torch.equal(before, torch.get_rng_state())


instantiate_parametrized_tests(TestSeeds)


if __name__ == "__main__":
    unittest.main()
