"""``IsolatedInProcess``: ``num_workers=0`` with global RNG states of the pipeline's own.

With workers, DataLoader2 seeds ``random``, ``torch`` and ``numpy`` inside each worker process;
with ``num_workers=0`` the pipeline shares the main process's global RNGs with the training loop,
whose draws between two items would change the data and keep a restore from replaying it.
With ``isolate_rng`` the pipeline gets its own
(:class:`~torchdata_snapshot.checkpoint.rng_states.IsolatedRNG`), seeded from DataLoader2's
generator at each epoch's start and swapped in around each step of the pipeline by the
checkpoint's outlet. Its DataPipes are seeded as torchdata seeds them with ``num_workers=0``: a
pipeline that draws only through its DataPipes (shuffles, samplers) yields torchdata's items.
"""

from __future__ import annotations

from typing import Callable, Optional

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot.checkpoint.rng_states import IsolatedRNG, seed_global_rngs
from torchdata_snapshot.checkpoint.seeds import own_seed_generator
from torchdata_snapshot.core.main.in_process import InProcess
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.messages import ElasticEpoch

__all__ = ["IsolatedInProcess"]


class IsolatedInProcess(InProcess):
    """An :class:`InProcess` whose pipeline has its own global RNG states (``rng``; ``None``
    without ``isolate_rng``: torchdata's)."""

    def __init__(self, datapipe: DataPipe, worker_init_fn: Optional[Callable], isolate_rng: bool) -> None:
        super().__init__(datapipe, worker_init_fn)
        self.rng = IsolatedRNG() if isolate_rng else None

    def start_epoch(
        self,
        outlet: Outlet,
        epoch: int,
        seed_generator: SeedGenerator,
        iter_reset_fn: Optional[Callable],
        elastic: Optional[ElasticEpoch] = None,
        replay: Optional[Callable] = None,
    ) -> None:
        """The pipeline's global states seeded from a generator of their own
        (:func:`own_seed_generator`), then its DataPipes seeded as torchdata seeds them in this
        process, from ``seed_generator``."""
        if self.rng is not None:
            with self.rng.active():
                seed_global_rngs(own_seed_generator(seed_generator))
        super().start_epoch(outlet, epoch, seed_generator, iter_reset_fn)
