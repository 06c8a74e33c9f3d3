"""``Session``: one run of the reading service, from ``initialize`` (or ``restore``) to ``finalize``.

It holds what exists only while the graph runs: the :class:`~torchdata_snapshot.core.main.runtime.Runtime`
and its :class:`~torchdata_snapshot.core.main.outlet.Outlet`, and the epoch in progress. The reading
service answers DataLoader2's calls and checks their order; what they act on is here, so that a
call is one line there and each operation can be tested without DataLoader2.

This session streams; it keeps no position to resume from: its :meth:`Session.checkpoint` is
``None`` (DataLoader2 then stores no state of the reading service, and a restored loader starts
its epoch over, as with torchdata's own reading service). The checkpoint's session extends it
(see :mod:`torchdata_snapshot.core.plugins`); the reading service runs the most capable one
installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot._constants import NO_EPOCH
from torchdata_snapshot._errors import ReadingServiceError
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.graph import graph_datapipes, pausable, pause_datapipe, paused
from torchdata_snapshot.core.main.in_process import InProcess
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.runtime import Runtime, start_workers
from torchdata_snapshot.core.options import RuntimeOptions
from torchdata_snapshot.core.seeding import seeding_epoch

__all__ = ["Session"]


@dataclass
class Session:
    """The running graph and the epoch in progress (see the module's docstring).

    ``epoch`` is the last epoch started (``NO_EPOCH`` before the first).
    """

    runtime: Runtime
    outlet: Outlet
    num_workers: int
    epoch: int = NO_EPOCH
    paused: bool = False
    main_datapipes: List[DataPipe] = field(init=False)  # what runs in this process

    def __post_init__(self) -> None:
        self.main_datapipes = [dp for _, dp in graph_datapipes(self.outlet)]

    # --- what a session of this class starts ----------------------------------------------------

    @classmethod
    def open(cls, datapipe: DataPipe, options: RuntimeOptions, plan: Any = None) -> Session:
        """Start running ``datapipe`` as ``options`` say; ``plan``: a restore planned by
        :meth:`plan` (of a session that restores)."""
        fields = cls._restored(datapipe, plan)  # (before the runtime changes the graph)
        runtime = cls._start_runtime(datapipe, options)
        try:
            outlet = cls._outlet(runtime, options)
        except BaseException:
            runtime.shutdown(0.0)
            raise
        return cls(runtime, outlet, options.num_workers, **fields)

    @classmethod
    def _restored(cls, datapipe: DataPipe, plan: Any) -> Dict[str, Any]:
        """The fields of a session of this class beyond the core's, for ``datapipe`` and ``plan``."""
        if plan is not None:
            raise ReadingServiceError("this session cannot restore a checkpoint")
        return {}

    @classmethod
    def _start_runtime(cls, datapipe: DataPipe, options: RuntimeOptions) -> Runtime:
        if options.num_workers:
            return start_workers(datapipe, options)
        return InProcess(datapipe, options.worker.custom_init_fn)

    @classmethod
    def _outlet(cls, runtime: Runtime, options: RuntimeOptions) -> Outlet:
        return Outlet(runtime.end, runtime.positions)

    # --- checkpoints ----------------------------------------------------------------------------

    @classmethod
    def before_start(cls, num_workers: int) -> Optional[Dict[str, Any]]:
        """The checkpoint of a reading service that has not run (``None``: none)."""
        return None

    @classmethod
    def plan(cls, datapipe: DataPipe, state: Any, num_workers: int, elastic: bool) -> Any:
        """What restoring ``state`` for ``datapipe`` resumes, validated, before anything starts."""
        raise ReadingServiceError(
            "this reading service keeps no mid-epoch state to restore: its checkpoint module is not installed"
        )

    def checkpoint(self) -> Optional[Dict[str, Any]]:
        """The checkpoint at the user's position (``None``: none, the epoch restarts)."""
        return None

    # --- epochs and DataLoader2's calls ---------------------------------------------------------

    @property
    def broken(self) -> bool:
        return self.runtime.broken is not None

    def start_epoch(
        self, seed_generator: SeedGenerator, iter_reset_fn: Optional[Callable[[DataPipe], DataPipe]]
    ) -> None:
        """Start the next epoch with ``seed_generator``'s seeds (:mod:`torchdata_snapshot.core.seeding`)."""
        self.epoch += 1
        with seeding_epoch(seed_generator, in_workers=bool(self.num_workers)):
            self.runtime.start_epoch(self.outlet, self.epoch, seed_generator, iter_reset_fn)
        self.outlet.start_epoch(self.epoch)

    def pause(self, pause_fn: Optional[Callable[[DataPipe], DataPipe]]) -> None:
        """Pause main-process DataPipes (prefetchers, ``fullsync``), then the workers."""
        for dp in pausable(self.main_datapipes):
            pause_datapipe(dp)
        self.runtime.pause(pause_fn)
        self.paused = True

    def resume(self, resume_fn: Optional[Callable[[DataPipe], DataPipe]]) -> None:
        self.runtime.resume(resume_fn)
        for dp in reversed(pausable(self.main_datapipes)):
            dp.resume()
        self.paused = False

    def limit(
        self, num_batches: Optional[int], limit_fn: Callable[[DataPipe, Optional[int]], DataPipe]
    ) -> None:
        self.runtime.limit(num_batches, limit_fn)
        limit_fn(self.outlet, num_batches)

    def snapshot(self) -> List[WorkerSnapshot]:
        """One snapshot per process running the graph, with main-process threads paused."""
        with paused([] if self.paused else pausable(self.main_datapipes)):
            return self.runtime.snapshot(self.outlet, self.epoch, self.paused)
