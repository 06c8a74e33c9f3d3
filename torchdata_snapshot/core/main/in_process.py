"""``InProcess``: ``num_workers=0``, the whole graph runs in the main process.

It is seeded as the only worker's graph would be (DataPipe seeds and the ``random``, ``torch``
and ``numpy`` global RNGs), with global RNG states of its own (``isolate_rng``, see
:mod:`torchdata_snapshot.checkpoint.rng_states`) so that the training loop's draws never change the data. The
outlet produces each item when the user asks for it, or ahead with ``read_ahead``. A restore
replays the epoch in the main process (see :mod:`torchdata_snapshot.core.main.outlet`).
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Tuple

from torchdata.dataloader2.graph import DataPipe, set_graph_random_seed
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils.worker import WorkerInfo, process_reset_fn

from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.checkpoint.format import WorkerPosition
from torchdata_snapshot.checkpoint.positions import UserPositions
from torchdata_snapshot.checkpoint.restore_plan import PendingRestore
from torchdata_snapshot.checkpoint.rng_states import IsolatedRNG
from torchdata_snapshot.core.graph import datapipe_state_dicts, datapipe_yields, graph_datapipes
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.worker.worker_graph import prepare_worker_graph

__all__ = ["InProcess"]


class InProcess:
    """Runs ``datapipe`` (after ``worker_init_fn``, as torchdata does) in the main process."""

    positions: Optional[UserPositions] = None  # the outlet replays: no position in worker streams
    broken: Optional[str] = None  # nothing to lose contact with

    def __init__(self, datapipe: DataPipe, worker_init_fn: Optional[Callable], isolate_rng: bool) -> None:
        self.end = prepare_worker_graph(datapipe, WorkerInfo(1, 0), worker_init_fn)
        self.rng = IsolatedRNG() if isolate_rng else None

    def start_epoch(
        self,
        outlet: Outlet,
        epoch: int,
        seed_generator: SeedGenerator,
        iter_reset_fn: Optional[Callable],
        resume: Optional[PendingRestore],
    ) -> None:
        """Seed the graph as the only worker's; ``resume`` needs nothing here: the outlet replays
        the user's position (and an epoch resumes elastically only in workers)."""
        if self.rng is not None:
            with self.rng.active():
                process_reset_fn(outlet, WorkerInfo(1, 0), seed_generator.spawn(0))
        else:
            set_graph_random_seed(outlet, seed_generator.spawn(0))

    def worker_positions(self, positions: Optional[UserPositions]) -> Tuple[WorkerPosition, ...]:
        return ()  # no worker: the outlet replays

    def pause(self, pause_fn: Optional[Callable]) -> None:
        pass  # the graph runs only when the user asks for an item

    def resume(self, resume_fn: Optional[Callable]) -> None:
        pass

    def limit(self, num_batches: Optional[int], limit_fn: Callable) -> None:
        pass  # the reading service applies limit_fn to the whole graph

    def snapshot(self, outlet: Outlet, epoch: int, paused: bool) -> List[WorkerSnapshot]:
        graph = graph_datapipes(outlet)
        delivered, ahead = outlet.delivered, outlet.produced_ahead
        snapshot = WorkerSnapshot(
            worker_id=0,
            role="in_process",
            pid=os.getpid(),
            epoch=epoch,
            produced=delivered + ahead,
            sent=delivered + ahead,
            buffered=0,
            received=delivered + ahead,
            handed_on=delivered,
            buffered_in_main=ahead,
            exhausted=outlet.finished,
            paused=paused,
            datapipe_yields=datapipe_yields(graph),
            datapipe_states=datapipe_state_dicts(graph),
        )
        return [snapshot]

    def shutdown(self, join_timeout_s: float) -> None:
        pass
