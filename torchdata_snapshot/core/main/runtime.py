"""``Runtime``: what the reading service asks of the place where the graph runs.

Two runtimes have it: :class:`~torchdata_snapshot.core.main.in_process.InProcess`
(``num_workers=0``: the whole graph runs in the main process) and
:class:`~torchdata_snapshot.core.main.worker_processes.WorkerProcesses` (the replicable part
runs in worker processes, and in a dispatching process what runs once). The reading service's
:class:`~torchdata_snapshot.core.session.Session` starts one and drives it through this protocol,
behind the :class:`~torchdata_snapshot.core.main.outlet.Outlet` that counts what the user received.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Protocol

import torch.multiprocessing as mp
from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.main.consumer import WorkerConsumer, credit_window
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.positions import UserPositions
from torchdata_snapshot.core.main.worker_processes import WorkerProcesses
from torchdata_snapshot.core.messages import ElasticEpoch
from torchdata_snapshot.core.options import RuntimeOptions, TensorPoolOptions
from torchdata_snapshot.core.plugins import StreamLog

__all__ = ["Runtime", "shut_down_when_broken", "start_workers"]


class Runtime(Protocol):
    """The graph, running; every method is called by the reading service, in the main process."""

    @property
    def end(self) -> DataPipe:
        """The main process's graph, which the outlet reads."""

    @property
    def positions(self) -> Optional[UserPositions]:
        """The user's position in each worker's stream, or ``None`` (not tracked)."""

    @property
    def broken(self) -> Optional[str]:
        """Why the processes can no longer be trusted, or ``None``."""

    def start_epoch(
        self,
        outlet: Outlet,
        epoch: int,
        seed_generator: SeedGenerator,
        iter_reset_fn: Optional[Callable],
        elastic: Optional[ElasticEpoch] = None,
        replay: Optional[Callable[[WorkerConsumer], None]] = None,
    ) -> None:
        """Seed and reset the graph for ``epoch``; ``elastic``: the epoch resumes elastically (in
        workers); ``replay`` brings the workers' streams to a restored position before they
        produce (the checkpoint's, which the outlet replays where workers do not)."""

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


def start_workers(
    datapipe: DataPipe, options: RuntimeOptions, stream_log: Optional[Callable[[], StreamLog]] = None
) -> WorkerProcesses:
    """Run ``datapipe`` in ``options.num_workers`` worker processes (with
    ``tensor_pool_slot_bytes``, each worker gets a tensor pool whose slots grow up to that size,
    see :class:`~torchdata_snapshot.core.plugins.TensorPoolFeature`); ``stream_log`` makes the log
    each worker stream keeps (a checkpoint's)."""
    window = credit_window(options.num_workers, *options.prefetch)
    ctx = mp.get_context(options.multiprocessing_context)
    pool = None
    if options.tensor_pool_slot_bytes is not None:
        pool = TensorPoolOptions.for_window(window, options.tensor_pool_slot_bytes)
    return WorkerProcesses.start(
        datapipe, ctx, options.num_workers, options.worker, window, options.faults, pool, stream_log
    )


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
