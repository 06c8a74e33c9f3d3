"""``Runtime``: what the reading service asks of the place where the graph runs.

Two runtimes have it: :class:`~torchdata_snapshot.core.main.in_process.InProcess`
(``num_workers=0``: the whole graph runs in the main process) and
:class:`~torchdata_snapshot.core.main.worker_processes.WorkerProcesses` (the replicable part
runs in worker processes, and in a dispatching process what runs once). The reading service's
:class:`~torchdata_snapshot.core.session.Session` drives either through this protocol, behind
the :class:`~torchdata_snapshot.core.main.outlet.Outlet` that counts what the user received.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Protocol, Tuple

import torch.multiprocessing as mp
from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.checkpoint.format import WorkerPosition
from torchdata_snapshot.checkpoint.positions import UserPositions
from torchdata_snapshot.checkpoint.restore_plan import PendingRestore
from torchdata_snapshot.checkpoint.rng_states import IsolatedRNG
from torchdata_snapshot.core.main.consumer import credit_window
from torchdata_snapshot.core.main.in_process import InProcess
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.worker_processes import WorkerProcesses
from torchdata_snapshot.core.options import RuntimeOptions, TensorPoolOptions

__all__ = ["Runtime", "shut_down_when_broken", "start_runtime"]


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

    def pause(self, pause_fn: Optional[Callable]) -> None:
        """``DataLoader2.pause``: stop the graph's processes, applying ``pause_fn`` in each."""

    def resume(self, resume_fn: Optional[Callable]) -> None:
        """``DataLoader2.resume``: the reverse of :meth:`pause`, with ``resume_fn``."""

    def limit(self, num_batches: Optional[int], limit_fn: Callable) -> None:
        """``DataLoader2.limit``: apply ``limit_fn`` (``num_batches``) where the graph runs."""

    def snapshot(self, outlet: Outlet, epoch: int, paused: bool) -> List[WorkerSnapshot]:
        """One snapshot per process running the graph, at one consistent point."""

    def shutdown(self, join_timeout_s: float) -> None:
        """Stop every process, bounded; idempotent."""


def start_runtime(datapipe: DataPipe, options: RuntimeOptions) -> Tuple[Runtime, Outlet]:
    """Run ``datapipe`` as ``options`` say: in worker processes (``num_workers > 0``; with
    ``tensor_pool_slot_bytes``, each worker gets a tensor pool whose slots grow up to that size,
    see :class:`~torchdata_snapshot.core.plugins.TensorPoolFeature`) or in this process; and the
    outlet, the last DataPipe, that counts what the user receives from it."""
    runtime: Runtime
    worker = options.worker
    if options.num_workers:
        window = credit_window(options.num_workers, *options.prefetch)
        ctx = mp.get_context(options.multiprocessing_context)
        pool = None
        if options.tensor_pool_slot_bytes is not None:
            pool = TensorPoolOptions.for_window(window, options.tensor_pool_slot_bytes)
        runtime = WorkerProcesses.start(
            datapipe, ctx, options.num_workers, worker, window, options.faults, pool
        )
    else:
        runtime = InProcess(datapipe, worker.custom_init_fn, options.isolate_rng)
    outlet = Outlet(
        runtime.end,
        runtime.positions,
        verify=worker.restore.verify_replay,
        rng=runtime.rng,
        read_ahead=options.read_ahead,
    )
    return runtime, outlet


def shut_down_when_broken(method: Callable[..., Any]) -> Callable[..., Any]:
    """A control operation of the reading service: if it left the processes in an unknown state
    (a worker died, a wait timed out, Ctrl-C between a request and its answer), the service is
    shut down before the exception propagates: no process outlives the failure, no later call
    reads a stale answer. ``self`` has ``_broken()``, ``_finalized`` and ``finalize()``."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            if self._broken() and not self._finalized:
                self.finalize()
            raise

    return guarded
