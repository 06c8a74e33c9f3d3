"""An epoch's seeds: drawn from DataLoader2's generator as torchdata draws them, then the
generator advanced so that the next epoch gets other seeds.

An epoch's data and its workers' RNG states are a function of the graph and of the state of the
generator DataLoader2 hands to ``initialize_iteration``, nothing else: no epoch counter is mixed
in, so re-seeding DataLoader2's generator the same way (``dl.seed(s)``, or without it the global
``torch`` seed ``iter()`` draws it from) repeats an epoch exactly. Workers are seeded with
``seed_generator.spawn(worker_id)``, which does not advance the generator: with ``dl.seed(s)``,
unless a random DataPipe ran in the main process, every epoch would get the same seeds and
repeat the same shuffle. With ``num_workers=0`` the DataPipes draw from the generator itself, as
torchdata's do, and that advances it.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Iterator

from torchdata.dataloader2.random import SeedGenerator

__all__ = ["advance_epoch_seed", "seeding_epoch"]


def advance_epoch_seed(seed_generator: SeedGenerator) -> None:
    """Advance ``seed_generator`` in place, so that the next epoch gets other seeds: the shared
    stream moves by one draw, and the per-process stream (whose spawns depend on how it was
    seeded, not on its draws) is replaced by its spawn at an index drawn from itself, which keeps
    the rank-specific part ``DistributedReadingService`` put there."""
    seed_generator.generate_shared_seed()
    seed_generator.spawn(seed_generator.generate_seed(), inplace=True)


@contextlib.contextmanager
def seeding_epoch(seed_generator: SeedGenerator, in_workers: bool) -> Iterator[None]:
    """Around the seeding of an epoch from ``seed_generator``; after it, advance the generator
    (:func:`advance_epoch_seed`) unless the epoch runs in this process (not ``in_workers``) and
    its DataPipes drew from it, which advanced it as torchdata's do."""
    before = None if in_workers else pickle.dumps(seed_generator)
    yield
    if in_workers or pickle.dumps(seed_generator) == before:
        advance_epoch_seed(seed_generator)
