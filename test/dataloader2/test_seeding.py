"""An epoch's seeds: drawn as torchdata draws them, then DataLoader2's generator advanced so that
the next epoch gets other seeds, unless the epoch's own draws advanced it."""

import pickle
import unittest

from torch.testing._internal.common_utils import TestCase
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot.core.seeding import advance_epoch_seed, seeding_epoch


def state(generator: SeedGenerator) -> bytes:
    return pickle.dumps(generator)


class TestSeeding(TestCase):
    def test_advancing_moves_both_streams_the_same_way_for_the_same_state(self) -> None:
        first, again = SeedGenerator(3), SeedGenerator(3)
        before = (first.spawn(0).generate_shared_seed(), first.spawn(0).generate_seed())
        advance_epoch_seed(first)
        advance_epoch_seed(again)
        after = (first.spawn(0).generate_shared_seed(), first.spawn(0).generate_seed())
        self.assertNotEqual(before[0], after[0], "the shared stream moved")
        self.assertNotEqual(before[1], after[1], "and each worker's spawn")
        self.assertEqual(state(first), state(again), "a function of the state only")

    def test_workers_seeds_leave_the_generator_as_it_was_so_it_is_advanced(self) -> None:
        generator = SeedGenerator(3)
        at_start = state(generator)
        with seeding_epoch(generator, in_workers=True):
            generator.spawn(0), generator.spawn(1)  # what seeding workers does
        self.assertNotEqual(state(generator), at_start)

    def test_in_process_draws_advance_the_generator_as_torchdatas_do(self) -> None:
        generator, reference = SeedGenerator(3), SeedGenerator(3)
        with seeding_epoch(generator, in_workers=False):
            generator.generate_shared_seed()  # a shuffle seeded in this process
        reference.generate_shared_seed()
        self.assertEqual(state(generator), state(reference), "nothing more: torchdata's next seeds")
        idle = SeedGenerator(3)
        with seeding_epoch(idle, in_workers=False):
            pass  # nothing random in the graph
        self.assertNotEqual(state(idle), state(SeedGenerator(3)), "advanced: the next epoch differs")

    def test_a_seeding_that_fails_advances_nothing(self) -> None:
        generator = SeedGenerator(3)
        with self.assertRaises(RuntimeError), seeding_epoch(generator, in_workers=True):
            raise RuntimeError("a reset function failed")
        self.assertEqual(state(generator), state(SeedGenerator(3)))


if __name__ == "__main__":
    unittest.main()
