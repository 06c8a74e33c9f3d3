"""``Runtime``: what the reading service asks of the place where the graph runs.

Two runtimes have it: :class:`~torchdata_snapshot._in_process.InProcess` (``num_workers=0``: the
whole graph runs in the main process) and :class:`~torchdata_snapshot._worker_pool.WorkerPool`
(the replicable part runs in worker processes, and in a dispatching process what runs once). The
reading service drives either through this protocol, behind the
:class:`~torchdata_snapshot._outlet.Outlet` that counts what the user received.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Tuple

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._checkpoint import WorkerPosition
from torchdata_snapshot._outlet import Outlet
from torchdata_snapshot._positions import UserPositions
from torchdata_snapshot._restore_plan import PendingRestore
from torchdata_snapshot._rng import IsolatedRNG
from torchdata_snapshot._worker_snapshot import WorkerSnapshot

__all__ = ["Runtime"]


class Runtime(Protocol):
    """The graph, running; every method is called by the reading service, in the main process."""

    @property
    def end(self) -> DataPipe:
        """The main process's graph, which the outlet reads."""

    @property
    def positions(self) -> Optional[UserPositions]:
        """The user's position in each worker's stream, or ``None`` (the outlet replays)."""

    @property
    def rng(self) -> Optional[IsolatedRNG]:
        """The graph's own global RNG states, swapped in around each item, or ``None``."""

    @property
    def broken(self) -> Optional[str]:
        """Why the processes can no longer be trusted, or ``None``."""

    def start_epoch(
        self,
        outlet: Outlet,
        epoch: int,
        seed_generator: SeedGenerator,
        iter_reset_fn: Optional[Callable],
        resume: Optional[PendingRestore],
    ) -> None:
        """Seed and reset the graph for ``epoch``; ``resume``: the restore it resumes (the
        outlet replays what its runtime does not)."""

    def worker_positions(self, positions: Optional[UserPositions]) -> Tuple[WorkerPosition, ...]:
        """What a checkpoint records of each worker's stream at the user's ``positions``."""

    def pause(self, pause_fn: Optional[Callable]) -> None: ...

    def resume(self, resume_fn: Optional[Callable]) -> None: ...

    def limit(self, num_batches: Optional[int], limit_fn: Callable) -> None: ...

    def snapshot(self, outlet: Outlet, epoch: int, paused: bool) -> List[WorkerSnapshot]:
        """One snapshot per process running the graph, at one consistent point."""

    def shutdown(self, join_timeout_s: float) -> None:
        """Stop every process, bounded; idempotent."""
