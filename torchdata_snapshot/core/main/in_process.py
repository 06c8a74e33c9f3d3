"""``InProcess``: ``num_workers=0``, the whole graph runs in the main process.

Its DataPipes are seeded as torchdata seeds them with ``num_workers=0`` (from DataLoader2's
generator itself), and the outlet produces each item when the user asks for it: the same items,
side effects and draws from the global RNGs as torchdata's. The checkpoint extends it with
global RNG states of the pipeline's own (``isolate_rng``), so that the training loop's draws
never change the data and a restore can replay the epoch in the main process.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional

from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._compat.datapipes import answer_child_checks
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.graph import datapipe_state_dicts, datapipe_yields, graph_datapipes
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.positions import UserPositions
from torchdata_snapshot.core.messages import ElasticEpoch
from torchdata_snapshot.core.traversal import seed_graph, traverse
from torchdata_snapshot.core.worker.worker_graph import prepare_worker_graph

__all__ = ["InProcess"]


class InProcess:
    """Runs ``datapipe`` (after ``worker_init_fn``, as torchdata does) in the main process."""

    positions: Optional[UserPositions] = None  # no position in worker streams
    broken: Optional[str] = None  # nothing to lose contact with

    def __init__(self, datapipe: DataPipe, worker_init_fn: Optional[Callable]) -> None:
        self.end = prepare_worker_graph(datapipe, WorkerInfo(1, 0), worker_init_fn)

    def start_epoch(
        self,
        outlet: Outlet,
        epoch: int,
        seed_generator: SeedGenerator,
        iter_reset_fn: Optional[Callable],
        elastic: Optional[ElasticEpoch] = None,
        replay: Optional[Callable] = None,
    ) -> None:
        """Seed the graph's DataPipes from ``seed_generator``, as torchdata does with
        ``num_workers=0`` (``elastic`` and ``replay`` concern workers only: an epoch resumes
        elastically only there, and a position in this process is replayed by the outlet)."""
        graph = traverse(outlet)
        seed_graph(graph, seed_generator)
        answer_child_checks(dp for _, dp in graph_datapipes(outlet, graph))

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
