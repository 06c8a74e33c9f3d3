"""A worker's part of stateful restore: whether its graph captures states, when it captures one,
loading the state a restore brings, and the files the graph's readers opened since the last item.

The worker loop (:mod:`torchdata_snapshot.core.worker.loop`) holds one :class:`WorkerStates` and
calls it at the points of an epoch where states matter; the graph's states themselves are
:class:`~torchdata_snapshot.graph_state.graph_state.GraphState`'s, their pacing
:class:`~torchdata_snapshot.graph_state.capture.CapturePacer`'s.
"""

from __future__ import annotations

import time
import warnings
from typing import List, Optional, Sequence, Tuple

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._errors import StateCaptureError
from torchdata_snapshot.core.options import WorkerOptions
from torchdata_snapshot.graph_state.capture import CapturePacer
from torchdata_snapshot.graph_state.file_origins import pack_opened
from torchdata_snapshot.graph_state.graph_state import GraphState
from torchdata_snapshot.graph_state.readers import StreamMaker
from torchdata_snapshot.graph_state.state_functions import (
    StateFunctions,
    check_state_functions_pickle,
    graph_state_functions,
)

__all__ = ["WorkerStates", "carried_state_functions"]

Graph = List[Tuple[str, DataPipe]]


class WorkerStates:
    """The states of one worker's graph: ``stateful`` once :meth:`prepare` made the graph
    resumable; then captured after the items the pacer picks, and loaded on restore."""

    def __init__(self, options: WorkerOptions, state_functions: Sequence[StateFunctions], name: str) -> None:
        self.options = options
        self.name = name
        self.stateful = False
        self.graph_state = GraphState(state_functions)
        self.pacer = CapturePacer(options.restore.max_items_between_captures, time.perf_counter)
        self._openers: List[StreamMaker] = []

    def prepare(self, datapipe: DataPipe, dispatched: bool) -> DataPipe:
        """The graph rewritten for stateful restore when it allows it (and the options do; a graph
        fed by a dispatching process, ``dispatched``, never does); raises
        :class:`StateCaptureError` when ``stateful=True`` asks for what it cannot."""
        restore = self.options.restore
        if restore.stateful is False:
            return datapipe
        if dispatched:
            if restore.stateful:
                raise StateCaptureError(
                    "stateful=True is not available with sharding_round_robin_dispatch: the dispatching "
                    "process is restored by replay only; use stateful=None (or False)"
                )
            return datapipe
        culprit = self.graph_state.unresumable(datapipe)
        if culprit is None:
            self.stateful = True
            return self.graph_state.make_resumable(datapipe)
        if restore.stateful:
            raise StateCaptureError(
                f"stateful=True, but DataPipe {culprit} can neither report nor load its state: implement "
                "state_dict()/load_state_dict() or call torchdata_snapshot.register_state_functions()"
            )
        return datapipe

    def end_epoch(self, graph: Graph) -> None:
        """Before the reset of the next epoch: the states of this one no longer apply."""
        self.graph_state.reset(graph)

    def start_epoch(self, graph: Graph) -> None:
        """After the reset (which may have replaced DataPipes): the graph's readers, the pacer."""
        self._openers = [dp for _, dp in graph if isinstance(dp, StreamMaker)]
        self.take_opened()  # (of an epoch that is over)
        self.pacer.start_epoch()

    @property
    def reads_files(self) -> bool:
        return bool(self._openers)

    def take_opened(self) -> Optional[bytes]:
        """The files the graph opened since the last call, packed to travel with an item."""
        opened = [origin for opener in self._openers for origin in opener.take_opened()]
        return pack_opened(opened) if opened else None

    def capture_due(self, produced: int) -> bool:
        return self.stateful and self.pacer.due(produced)

    def capture(self, graph: Graph, produced: int) -> Optional[bytes]:
        """The graph's state after its ``produced``-th item, or ``None`` if it cannot be captured:
        then this worker is restored by replay from now on (a warning says so); the training run
        must not fail for this."""
        start = time.thread_time()  # the capture's own cost, not waits for the GIL
        try:
            blob = self.graph_state.capture(graph)
        except StateCaptureError as e:
            warnings.warn(
                f"{self.name}: {e}; restores will replay this worker's stream", RuntimeWarning, stacklevel=3
            )
            self.stateful = False
            return None
        self.pacer.captured(produced, time.thread_time() - start)
        return blob

    def load(self, graph: Graph, blob: bytes, sharding: Optional[ShardingFilterIterDataPipe]) -> int:
        """Load a captured state into the graph; the elements its sharding filter had taken before
        the iteration that state resumes (0 without a sharding filter)."""
        self.graph_state.load(graph, blob)
        return 0 if sharding is None else self.graph_state.sharding.taken_before(sharding)


def carried_state_functions(
    datapipe: DataPipe, options: WorkerOptions, start_method: str
) -> Tuple[StateFunctions, ...]:
    """The registered state functions that the workers of ``datapipe`` need (none when they
    capture no state), for the worker's entry point: a worker started by ``spawn`` or
    ``forkserver`` does not run the code that registered them. Raises :class:`StateCaptureError`
    naming one that cannot reach such a worker."""
    if options.restore.stateful is False:
        return ()
    carried = graph_state_functions(datapipe)
    if start_method != "fork":  # forked workers inherit them; the others unpickle them
        check_state_functions_pickle(carried, start_method)
    return carried
