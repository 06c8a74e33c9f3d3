"""The main-process end of the workers: round-robin over their streams with exact counts.

:class:`WorkerConsumer` replaces the queue-based loop's ``_IterateQueueDataPipes`` (and the ``QueueWrapper``
per worker). It is the DataPipe that stands, in the main process's graph, where the replicable
branch was: it hands out the workers' items in a fixed round-robin order (one
:class:`~torchdata_snapshot.core.main.worker_record.WorkerRecord` per worker), starts, restores and
controls the workers' epochs, all through :class:`~torchdata_snapshot.core.main.links.WorkerLinks`. See
NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from torch.utils.data import IterDataPipe
from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._constants import CLOSED_EPOCH, DEFAULT_CONTROL_TIMEOUT_S, TERMINATE_LOCK_WAIT_S
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.main.links import Replacer, WorkerLinks
from torchdata_snapshot.core.main.positions import UserPositions
from torchdata_snapshot.core.main.worker_record import WorkerRecord
from torchdata_snapshot.core.messages import (
    ElasticEpoch,
    GetNextRequest,
    GetStateRequest,
    GetStateResponse,
    LimitRequest,
    LimitResponse,
    PauseRequest,
    PauseResponse,
    ReplayRequest,
    ReplayResponse,
    ResetEpochRequest,
    ResetEpochResponse,
    ResumeRequest,
    ResumeResponse,
)
from torchdata_snapshot.core.plugins import StreamLog
from torchdata_snapshot.core.transport.batches import END, Raised
from torchdata_snapshot.core.transport.channel import Channel

__all__ = ["WorkerConsumer", "credit_window"]


def credit_window(num_workers: int, worker_prefetch_cnt: int, main_prefetch_cnt: int) -> int:
    """Items that may be outstanding per worker: its own prefetch, its share of the main
    process's prefetch, and the one item being asked for."""
    return worker_prefetch_cnt + -(-main_prefetch_cnt // max(1, num_workers)) + 1


class WorkerConsumer(IterDataPipe):
    """Round-robin over the workers' streams, with credit-based prefetching and exact counts.

    Args:
        channels: one per worker, in worker order.
        window: the credit kept outstanding per worker (see :func:`credit_window`).
        control_timeout_s: bound on waiting for the answer to a control request.
        data_timeout_s: bound on waiting for an item (``None``: as long as the worker lives).
        positions: the user's position in each stream, when the reading service tracks it;
            each item handed on is recorded there, and digests and states behind it are dropped.
        replacer: self-healing (see :mod:`torchdata_snapshot.core.plugins`): gives a worker that
            died a new process (``None``: a death is an error).
        small_items_bytes: the window of a stream of small items that travel whole in their
            pickles grows to cover this many of their bytes (see
            :func:`~torchdata_snapshot.core.transport.batches.small_items_window`; ``0``: it does not).
        stream_log: makes each stream's log (a checkpoint's: see
            :class:`~torchdata_snapshot.core.plugins.StreamLog`), or ``None``: none is kept.
    """

    def __init__(
        self,
        channels: Sequence[Channel],
        window: int,
        control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
        data_timeout_s: Optional[float] = None,
        *,
        positions: Optional[UserPositions] = None,
        replacer: Optional[Replacer] = None,
        small_items_bytes: int = 0,
        stream_log: Optional[Callable[[], StreamLog]] = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.streams = [
            WorkerRecord(
                worker_id, channel, window, small_items_bytes, None if stream_log is None else stream_log()
            )
            for worker_id, channel in enumerate(channels)
        ]
        self.num_workers = len(self.streams)
        self.window = window
        self.positions = positions
        # When (time.time()) the last worker to start began to serve, as of the last epoch reset.
        self.workers_serving_since: Optional[float] = None
        self.links = WorkerLinks(self.streams, control_timeout_s, data_timeout_s, positions, replacer)
        self.next_worker = 0

    @property
    def epoch(self) -> int:
        return self.links.epoch

    @property
    def broken(self) -> Optional[str]:
        """Why the pipes can no longer be trusted (an exchange was interrupted), or ``None``."""
        return self.links.broken

    # DataPipe graph traversal pickles DataPipes to find their parents: this one has none, and
    # its pipes and processes must never be pickled.
    def __getstate__(self) -> Dict[str, Any]:
        return {"num_workers": self.num_workers, "window": self.window}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__([], max(1, state["window"]))  # type: ignore[misc]
        self.num_workers = state["num_workers"]
        self.links.closed = True

    def __iter__(self) -> Iterator[Any]:
        return _ConsumerIterator(self, self.epoch)

    # --- data path ------------------------------------------------------------------------------

    def next_item(self, epoch: int) -> Any:
        """The next item of the round-robin order; ``StopIteration`` when every stream ended."""
        links = self.links
        with links.lock:
            links.check_not_broken()
            if epoch != links.epoch or links.closed:
                raise StopIteration
            while True:
                if all(stream.exhausted for stream in self.streams):
                    raise StopIteration
                stream = self.streams[self.next_worker]
                if stream.exhausted:
                    self.next_worker = (stream.worker_id + 1) % self.num_workers
                    continue
                if not stream.buffer:
                    # (A worker found dead and replaced continues exactly where the dead one stopped.)
                    links.read(stream, timeout_s=links.data_timeout_s, what="an item")
                    continue
                entry = stream.take()
                self.next_worker = (stream.worker_id + 1) % self.num_workers
                if entry is END:
                    continue
                if isinstance(entry, Raised):
                    entry.exc.reraise()
                self._grant(stream)
                if self.positions is not None:
                    self.positions.handed_on(stream.worker_id)
                return entry

    def _grant(self, stream: WorkerRecord) -> None:
        count = stream.grant()
        if count:
            self.links.send(stream, GetNextRequest(self.epoch, count), heal=True)

    # --- epochs ---------------------------------------------------------------------------------

    def reset_epoch(
        self,
        epoch: int,
        seed_generators: Sequence[Any],
        iter_reset_fn: Optional[Callable],
        elastic: Optional[ElasticEpoch] = None,
    ) -> None:
        """Reset every worker to ``epoch``; everything still in flight from before is dropped.
        ``elastic``: the epoch resumes elastically (see
        :class:`~torchdata_snapshot.core.messages.ElasticEpoch`).

        The workers produce nothing until :meth:`start_epoch` grants them credit, so that the
        dispatching process (if any) can be reset, and a restore replayed, in between.
        """
        links = self.links
        with links.lock:
            links.check_open()
            links.epoch = epoch  # from here on, responses of older epochs are stale
            requests = [
                ResetEpochRequest(seed, iter_reset_fn, epoch=epoch, elastic=elastic)
                for seed in seed_generators
            ]
            links.reset_requests = requests
            for stream in self.streams:
                stream.restarts = 0
            # The streams are at the epoch's beginning from here on: a worker found dead during
            # the reset (or the replay of a restore) is replaced at that position.
            for stream in self.streams:
                stream.start()
            self.next_worker = 0
            links.in_epoch = True
            answers = links.request_all(requests.__getitem__, ResetEpochResponse)
        serving = [answer.serving_since for answer in answers if answer.serving_since is not None]
        self.workers_serving_since = max(serving, default=None)

    def replay(self, requests: Sequence[ReplayRequest], positions: Sequence[Any], next_worker: int) -> None:
        """Restore: worker ``i`` replays (and drops) the items the user already had, as
        ``requests[i]`` asks; its stream then starts at ``positions[i]`` (its log's record of that
        point, whose ``delivered`` items are counted as handed on), and the round-robin at
        ``next_worker``. Workers whose stream had ended are found again on the way, at the same
        places."""
        with self.links.lock:
            self.links.progress.start()
            self.links.request_all(requests.__getitem__, ReplayResponse)
            for stream, position in zip(self.streams, positions):
                stream.start(position.delivered, position)
            self.next_worker = next_worker

    def start_epoch(self) -> None:
        """Grant every worker its first credit window: production of the epoch starts."""
        with self.links.lock:
            for stream in self.streams:
                self._grant(stream)

    # --- pause, resume, limit, snapshot, shutdown -----------------------------------------------

    def request_pause(self, pause_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        self.links.request_all(lambda i: PauseRequest(pause_fn), PauseResponse)
        self.links.paused = True

    def request_resume(self, resume_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        self.links.request_all(lambda i: ResumeRequest(resume_fn), ResumeResponse)
        self.links.paused = False

    def request_limit(
        self,
        num_batches: Optional[int],
        limit_fn: Optional[Callable] = None,
        worker_num_batches: Optional[Sequence[int]] = None,
    ) -> None:
        def limit(i: int) -> LimitRequest:
            return LimitRequest(
                num_batches, limit_fn, None if worker_num_batches is None else worker_num_batches[i]
            )

        self.links.request_all(limit, LimitResponse)

    def request_snapshot(
        self, include_datapipe_states: bool = True, dispatcher_sent: Optional[Sequence[int]] = None
    ) -> List[WorkerSnapshot]:
        """One :class:`WorkerSnapshot` per worker, with the main-process counts filled in.

        ``dispatcher_sent`` (from a paused dispatching process) makes each worker read the
        dispatched items still in flight before answering: a consistent cut across processes.
        """

        def get_state(i: int) -> GetStateRequest:
            return GetStateRequest(
                None if dispatcher_sent is None else dispatcher_sent[i], include_datapipe_states
            )

        with self.links.lock:
            answers = self.links.request_all(get_state, GetStateResponse)
            return [
                replace(
                    answer.snapshot,
                    received=stream.received,
                    handed_on=stream.handed_on,
                    buffered_in_main=stream.received - stream.handed_on,
                )
                for stream, answer in zip(self.streams, answers)
            ]

    def request_terminate(self, timeout_s: float) -> bool:
        """Ask every worker to stop and read up to its answer (bounded). Idempotent.

        Returns whether every worker said goodbye; if not (a worker is dead or stuck, the pipes
        cannot be trusted, or another thread is in the middle of an exchange) the caller kills
        them.
        """
        links = self.links
        if not links.lock.acquire(timeout=TERMINATE_LOCK_WAIT_S):
            # Another thread is mid-exchange (a snapshot, a read in a tail's thread): it will
            # see ReadingServiceClosedError once the processes are killed.
            links.closed = True
            return False
        try:
            if links.closed:
                return True
            links.closed = True
            if links.broken is not None:
                return False  # the pipes cannot be trusted
            links.epoch = CLOSED_EPOCH  # whatever is still in flight is stale
            return links.terminate(timeout_s)
        finally:
            links.lock.release()

    def close(self) -> None:
        """Close the pipes and drop what was buffered from them (and its shared memory), on every
        path: after a goodbye, a worker's death or a timeout alike."""
        for stream in self.streams:
            stream.channel.close()
            stream.buffer.clear()


class _ConsumerIterator:
    """The iterator of one epoch of a :class:`WorkerConsumer`."""

    __slots__ = ("consumer", "epoch")

    def __init__(self, consumer: WorkerConsumer, epoch: int) -> None:
        self.consumer = consumer
        self.epoch = epoch

    def __iter__(self) -> _ConsumerIterator:
        return self

    def __next__(self) -> Any:
        return self.consumer.next_item(self.epoch)
