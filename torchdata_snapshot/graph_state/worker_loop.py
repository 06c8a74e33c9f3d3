"""``StatefulWorkerLoop``: the worker loop that restores from captured graph states.

It extends :class:`~torchdata_snapshot.checkpoint.worker_loop.ReplayingWorkerLoop`: where its
graph allows it, the graph is made resumable before the first epoch, its state is captured behind
the items the pacer picks (``StateMarkResponse``), and a ``ReplayRequest`` that brings a state
loads it and replays only the items after it. The files a graph's readers open travel with the
items that opened them, and a replay checks them first. Elastic resume plugs in here too
(``elastic_worker`` in :mod:`torchdata_snapshot.core.plugins`). The states themselves are
:class:`~torchdata_snapshot.graph_state.worker_states.WorkerStates`'.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Sequence

from torch.utils.data.datapipes.iter.sharding import ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, DataPipeGraph
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._errors import ExceptionWrapper, ProtocolError, StateCaptureError
from torchdata_snapshot.checkpoint.digest import parse_chain_hex
from torchdata_snapshot.checkpoint.worker_loop import ReplayingWorkerLoop
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.core.messages import ElasticEpoch, ReplayRequest, ResetEpochRequest, StateMarkResponse
from torchdata_snapshot.core.options import WorkerOptions
from torchdata_snapshot.core.plugins import installed
from torchdata_snapshot.core.transport.batches import QueuedItem
from torchdata_snapshot.core.transport.channel import Endpoint
from torchdata_snapshot.core.traversal import traverse
from torchdata_snapshot.core.worker.dispatcher import find_dispatched_sources
from torchdata_snapshot.core.worker.epoch import WorkerEpoch
from torchdata_snapshot.graph_state.file_origins import check_opened
from torchdata_snapshot.graph_state.graph_state import GraphState
from torchdata_snapshot.graph_state.state_functions import StateFunctions
from torchdata_snapshot.graph_state.worker_states import WorkerStates, carried_state_functions

__all__ = ["ElasticWorker", "StatefulWorkerLoop"]


class ElasticWorker(Protocol):
    """Elastic resume (an optional feature, ``elastic_worker`` in :mod:`torchdata_snapshot.core.plugins`),
    in a worker: counts how far into its element the graph's expander is (what each item carries
    as ``partial``) and, in an epoch resumed elastically, deals only what remains of it."""

    def prepare(self, datapipe: DataPipe) -> DataPipe:
        """The worker's graph (not resumable as a whole) with an expander that counts."""

    def reset_epoch(
        self,
        datapipe: DataPipe,
        sharding: ShardingFilterIterDataPipe,
        elastic: Optional[ElasticEpoch],
        graph_state: GraphState,
        stateful: bool,
        graph: DataPipeGraph,
    ) -> bool:
        """Set up the epoch about to start (``elastic``: it resumes elastically), ``graph`` being
        ``datapipe``'s; returns whether it changed the graph."""

    def partial(self) -> Optional[int]:
        """At a yield point: the items of the expander's current element handed on."""


class StatefulWorkerLoop(ReplayingWorkerLoop):
    """A :class:`ReplayingWorkerLoop` whose graph's states are captured and loaded
    (``state_functions``: those of
    :func:`~torchdata_snapshot.graph_state.worker_states.carried_state_functions`)."""

    CAPTURES_STATES = True

    def __init__(
        self,
        datapipe: DataPipe,
        endpoint: Endpoint,
        worker_info: WorkerInfo,
        *,
        options: WorkerOptions = WorkerOptions(),
        state_functions: Sequence[StateFunctions] = (),
        **kwargs: Any,
    ) -> None:
        # Both are used by _prepare, which the base's constructor calls; the states are named
        # once the loop is.
        self.states = WorkerStates(options, state_functions, name="")
        # Elastic resume's part, when its folder is there (see torchdata_snapshot.core.plugins).
        make_elastic = installed().elastic_worker
        self._elastic: Optional[ElasticWorker] = None if make_elastic is None else make_elastic()
        super().__init__(datapipe, endpoint, worker_info, options=options, **kwargs)
        self.states.name = self.name

    @classmethod
    def carried_arguments(
        cls, datapipe: DataPipe, options: WorkerOptions, start_method: str
    ) -> Dict[str, Any]:
        """The registered state functions the workers need (see :func:`carried_state_functions`)."""
        return {"state_functions": carried_state_functions(datapipe, options, start_method)}

    @property
    def stateful(self) -> bool:
        return self.states.stateful

    def _prepare(self, datapipe: DataPipe) -> DataPipe:
        try:
            datapipe = self.states.prepare(datapipe, bool(find_dispatched_sources(datapipe)))
        except StateCaptureError:
            self.init_error = ExceptionWrapper(where=f"in {self.name} while preparing stateful restore")
            return datapipe
        if not self.states.stateful and self._elastic is not None:
            datapipe = self._elastic.prepare(datapipe)
        return datapipe

    # --- streaming ------------------------------------------------------------------------------

    def _produce(self) -> None:
        self.states.pacer.start_producing()  # captures are paced by production time only
        try:
            super()._produce()
        finally:
            self.states.pacer.stop_producing()

    def _queued(self, epoch: WorkerEpoch, item: Any, payload: bytes) -> QueuedItem:
        queued = super()._queued(epoch, item, payload)
        if self._elastic is not None:
            queued.partial = self._elastic.partial()
        if self.states.reads_files:
            queued.opened = self.states.take_opened()
        return queued

    def _after_item(self, epoch: WorkerEpoch) -> None:
        """Send the graph's state after the item just produced when one is due (it travels behind
        that item); the pacer says when (see :mod:`torchdata_snapshot.graph_state.capture`)."""
        if self.states.capture_due(epoch.produced):
            blob = self.states.capture(self._graph, epoch.produced)
            if blob is not None:
                self.outbox.put(StateMarkResponse(epoch.number, epoch.produced, blob))

    def _end_epoch(self) -> None:
        self.states.end_epoch(self._graph)

    def _start_epoch(self, request: ResetEpochRequest, epoch: WorkerEpoch) -> None:
        super()._start_epoch(request, epoch)
        sharding = epoch.sharding
        if request.elastic is not None and (sharding is None or self._elastic is None):
            raise ProtocolError(f"{self.name}: an elastic epoch needs the graph's one sharding filter")
        if sharding is not None and self._elastic is not None:
            changed = self._elastic.reset_epoch(
                self.datapipe, sharding, request.elastic, self.states.graph_state, self.states.stateful,
                epoch.graph,
            )  # fmt: skip
            if changed:  # what remains went in below the filter, or left
                epoch.graph = traverse(self.datapipe)
                self._graph = graph_datapipes(self.datapipe, epoch.graph)
        self.states.start_epoch(self._graph)

    # --- restore --------------------------------------------------------------------------------

    def _replay_start(self, request: ReplayRequest, epoch: WorkerEpoch) -> int:
        check_opened(request.opened)  # files read again that no state names
        if request.state is None:
            return 0
        start, blob = request.state
        epoch.taken_before = self.states.load(self._graph, blob, epoch.sharding)
        epoch.iterator = iter(self.datapipe)  # starts from the loaded states
        # The digest carries on from the state's position, if the checkpoint knows it there.
        known = epoch.digest is not None and request.state_digest is not None
        epoch.digest = parse_chain_hex(request.state_digest) if known else None  # type: ignore[arg-type]
        return start

    def _replayed(self, epoch: WorkerEpoch) -> None:
        self.states.take_opened()  # the main process has them: the request brought them
        self.states.pacer.replayed(epoch.produced)


StatefulWorkerLoop.HANDLERS = dict(ReplayingWorkerLoop.HANDLERS)
