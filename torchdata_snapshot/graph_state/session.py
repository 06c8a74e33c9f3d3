"""``StatefulSession``: the checkpoint's session, for graphs restored from captured states.

Its workers run :class:`~torchdata_snapshot.graph_state.worker_loop.StatefulWorkerLoop`, which
captures their graphs' states; what it adds in the main process is the data directory that
moved: a ``FileLister`` root that is another path in the graph than in the checkpoint resumes
there, when the files the restore reads again are the same (see
:mod:`torchdata_snapshot.graph_state.moved_roots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot.checkpoint.format import Checkpoint
from torchdata_snapshot.checkpoint.identity import GraphIdentity
from torchdata_snapshot.checkpoint.session import CheckpointSession
from torchdata_snapshot.graph_state.moved_roots import moved_roots, resumed_where_moved

__all__ = ["StatefulSession"]


@dataclass
class StatefulSession(CheckpointSession):
    """A :class:`CheckpointSession` whose restores follow a data directory that moved."""

    @classmethod
    def _relocated(
        cls, taken: Checkpoint, datapipe: DataPipe, graph: GraphIdentity
    ) -> Tuple[Checkpoint, bool]:
        moves = moved_roots(taken, datapipe, graph)
        return resumed_where_moved(taken, moves), bool(moves)
