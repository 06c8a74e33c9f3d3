"""The main-process end of the workers: round-robin over worker channels with exact counts.

:class:`WorkerConsumer` replaces upstream's ``_IterateQueueDataPipes`` (and the ``QueueWrapper``
per worker). It is the DataPipe that stands, in the main process's graph, where the replicable
branch was; it hands out the workers' items in a fixed round-robin order and keeps, per worker,
the counters of NOTE [ Snapshot protocol ] (see :mod:`torchdata_snapshot._messages`).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Type

from torch.utils.data import IterDataPipe
from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._channel import Channel
from torchdata_snapshot._checkpoint import GraphState, WorkerPosition
from torchdata_snapshot._constants import (
    CLOSED_EPOCH,
    DEFAULT_CONTROL_TIMEOUT_S,
    NO_EPOCH,
    TERMINATE_LOCK_WAIT_S,
)
from torchdata_snapshot._digest import chain_hex, parse_chain_hex
from torchdata_snapshot._errors import (
    ProtocolError,
    ReadingServiceClosedError,
    ReadingServiceError,
    WorkerDiedError,
    WorkerError,
)
from torchdata_snapshot._messages import (
    ErrorResponse,
    GetNextRequest,
    GetStateRequest,
    GetStateResponse,
    ItemsResponse,
    LimitRequest,
    LimitResponse,
    PauseRequest,
    PauseResponse,
    ReplayProgressResponse,
    ReplayRequest,
    ReplayResponse,
    ResetEpochRequest,
    ResetEpochResponse,
    ResumeRequest,
    ResumeResponse,
    StateMarkResponse,
    TerminateRequest,
    TerminateResponse,
)
from torchdata_snapshot._stream import END, Credit, Raised, file_response
from torchdata_snapshot._worker_snapshot import WorkerSnapshot

__all__ = ["WorkerConsumer", "credit_window"]


#: Bytes of one running digest in ``ItemsResponse.digests``.
_DIGEST_SIZE = array("Q").itemsize


def _pack_digest(digest: str) -> bytes:
    return array("Q", [parse_chain_hex(digest)]).tobytes()


def credit_window(num_workers: int, worker_prefetch_cnt: int, main_prefetch_cnt: int) -> int:
    """Items that may be outstanding per worker: its own prefetch, its share of the main
    process's prefetch, and the one item being asked for."""
    return worker_prefetch_cnt + -(-main_prefetch_cnt // max(1, num_workers)) + 1


def _replay_request(epoch: int, position: WorkerPosition) -> ReplayRequest:
    """Bring a freshly reset worker to ``position``: from its recorded graph state when there is
    one (stateful restore), else from the epoch's start; the running digest of the replayed
    items is checked against the recorded one."""
    if position.state is None:
        return ReplayRequest(epoch, position.delivered, position.digest)
    start, blob, state_digest = position.state
    return ReplayRequest(epoch, position.delivered - start, position.digest, (start, blob), state_digest)


class _Healed(Exception):
    """Raised by ``_read`` after a dead worker was replaced: the read is to be done again."""


class WorkerConsumer(IterDataPipe):
    """Round-robin over the workers' streams, with credit-based prefetching and exact counts.

    Counters per worker for the current epoch (NOTE [ Snapshot protocol ]):
    ``received[i]`` items read from worker ``i``, ``delivered[i]`` items handed downstream,
    ``credits[i].granted`` credit sent; always ``received[i] == delivered[i] + len(buffers[i])``
    (not counting end markers) and ``delivered[i] <= received[i] <= credits[i].granted``.
    """

    def __init__(
        self,
        channels: Sequence[Channel],
        window: int,
        control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
        data_timeout_s: Optional[float] = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.channels = list(channels)
        self.num_workers = len(self.channels)
        self.window = window
        self.control_timeout_s = control_timeout_s
        self.data_timeout_s = data_timeout_s
        self.epoch = NO_EPOCH
        self.closed = False
        # Set when an operation was interrupted between a request and its answer, or a message
        # was lost: the pipes can no longer be trusted, and nothing may be read from them.
        self.broken: Optional[str] = None
        self.lock = threading.RLock()
        self.buffers: List[Deque[Any]] = [deque() for _ in self.channels]
        self.received = [0] * self.num_workers
        self.delivered = [0] * self.num_workers
        self.credits = [Credit(window) for _ in self.channels]
        self.exhausted = [True] * self.num_workers  # nothing to read before the first epoch
        self.next_worker = 0
        # Replay verification: each worker's running digests, per received batch
        # (first position, packed digests), from the batch holding the kept position on.
        self.digests: List[Deque[Tuple[int, bytes]]] = [deque() for _ in self.channels]
        # Stateful restore: the graph states workers capture every few items, from the latest
        # one strictly behind the kept position on (see `position_state`).
        self.states: List[Deque[GraphState]] = [deque() for _ in self.channels]
        self.best_states: List[Optional[GraphState]] = [None] * self.num_workers
        # Set by the reading service when the user's position in each stream is tracked:
        # every item handed downstream pushes its worker id (see Outlet).
        self.handoff: Optional[Deque[int]] = None
        self.user_position: Optional[List[int]] = None
        # Self-healing (off unless the reading service sets `respawn`): a worker that dies
        # mid-epoch is replaced and brought back to the items already received from it.
        self.respawn: Optional[Callable[[int], Channel]] = None
        self.restarts_allowed = 0
        self.restarts = [0] * self.num_workers
        self.paused = False
        self._epoch_seeds: Sequence[Any] = ()
        self._epoch_iter_reset_fn: Optional[Callable] = None

    # DataPipe graph traversal pickles DataPipes to find their parents: this one has none, and
    # its pipes and processes must never be pickled.
    def __getstate__(self) -> Dict[str, Any]:
        return {"num_workers": self.num_workers, "window": self.window, "closed": True, "channels": []}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__([], max(1, state["window"]))  # type: ignore[misc]
        self.num_workers = state["num_workers"]
        self.closed = True

    def __iter__(self) -> Iterator[Any]:
        return _ConsumerIterator(self, self.epoch)

    # --- data path ------------------------------------------------------------------------------

    def next_item(self, epoch: int) -> Any:
        """The next item of the round-robin order; ``StopIteration`` when every stream ended."""
        with self.lock:
            self._check_not_broken()
            if epoch != self.epoch or self.closed:
                raise StopIteration
            while True:
                if all(self.exhausted):
                    raise StopIteration
                worker_id = self.next_worker
                if self.exhausted[worker_id]:
                    self.next_worker = (worker_id + 1) % self.num_workers
                    continue
                buffer = self.buffers[worker_id]
                if not buffer:
                    try:
                        self._read(worker_id, timeout_s=self.data_timeout_s, what="an item")
                    except _Healed:
                        pass  # a fresh worker continues exactly where the dead one stopped
                    continue
                item = buffer.popleft()
                if item is END:
                    self.exhausted[worker_id] = True
                    self.next_worker = (worker_id + 1) % self.num_workers
                    continue
                if isinstance(item, Raised):
                    self.exhausted[worker_id] = True
                    item.exc.reraise()
                self.delivered[worker_id] += 1
                self.next_worker = (worker_id + 1) % self.num_workers
                self._top_up(worker_id)
                if self.handoff is not None:
                    self.handoff.append(worker_id)
                return item

    def _top_up(self, worker_id: int) -> None:
        count = self.credits[worker_id].top_up(self.delivered[worker_id])
        if count:
            try:
                self.channels[worker_id].send(GetNextRequest(self.epoch, count))
            except WorkerDiedError as e:
                if not self._may_heal(worker_id):
                    self.broken = f"{type(e).__name__}: {e}"
                    raise
                self._heal(worker_id, e)  # the new worker gets all outstanding credit, this grant included

    def _read(self, worker_id: int, timeout_s: Optional[float], what: str) -> Any:
        """Read one message from worker ``worker_id``; data goes to its buffer, others are returned.

        A read that does not complete (the worker died, the wait timed out, Ctrl-C) leaves the
        consumer ``broken``; after ``request_terminate`` a dead worker means "shut down".
        """
        channel = self.channels[worker_id]
        try:
            response = channel.recv(timeout_s, what=what)
            first = self.received[worker_id] + 1
            added = file_response(response, self.epoch, self.buffers[worker_id])
        except WorkerError as e:
            if self.closed:
                raise ReadingServiceClosedError(
                    f"the reading service was shut down while waiting for {what} from {channel.name}"
                ) from e
            if isinstance(e, WorkerDiedError) and self._may_heal(worker_id):
                self._heal(worker_id, e)
                raise _Healed from e
            self.broken = f"{type(e).__name__}: {e}"
            raise
        except BaseException as e:
            self.broken = f"{type(e).__name__} while waiting for {what}"
            raise
        if added is not None:
            if added:
                assert isinstance(response, ItemsResponse)
                if response.digests is not None:
                    self.digests[worker_id].append((first, response.digests))
                self.received[worker_id] += added
                self._prune_digests(worker_id, self._kept_position(worker_id))
            return None
        if isinstance(response, StateMarkResponse):
            if response.epoch == self.epoch:
                digest = self.position_digest(worker_id, response.position)
                self.states[worker_id].append((response.position, response.state, digest))
                self.position_state(worker_id, self._kept_position(worker_id))
            return None
        return response

    # --- control path ---------------------------------------------------------------------------

    def _await(self, worker_id: int, expected: Type[Any], what: str, request: Any = None) -> Any:
        """Read worker ``worker_id``'s pipe up to its response of type ``expected`` (or an
        ``ErrorResponse``, returned as well). Items read on the way are buffered: they precede
        the answer in the worker's stream. If the worker died and was replaced, ``request`` is
        sent again to the new one."""
        while True:
            try:
                response = self._read(worker_id, timeout_s=self.control_timeout_s, what=what)
            except _Healed:
                if request is None:
                    raise
                self._send(worker_id, request, heal=True)
                continue
            if response is None:
                continue
            if isinstance(response, (expected, ErrorResponse)):
                return response
            if isinstance(response, ReplayProgressResponse):
                continue  # a long replay, alive: the bounded wait starts again
            self.broken = f"unexpected {type(response).__name__}"
            raise ProtocolError(
                f"{self.channels[worker_id].name} answered {type(response).__name__} while "
                f"{expected.__name__} was expected"
            )

    def request_all(self, make_request: Callable[[int], Any], expected: Type[Any]) -> List[Any]:
        """Send one request to every worker, then collect every answer (in parallel, not in turn).

        All answers are read before an error answer is raised, so that no answer is left in a
        pipe; anything else that interrupts the exchange leaves the consumer ``broken``.
        """
        with self.lock:
            self._check_open()
            try:
                requests = [make_request(worker_id) for worker_id in range(self.num_workers)]
                # A request that only reads or sets state is sent again to a replaced worker.
                resendable = expected in (GetStateResponse, PauseResponse, ResumeResponse, LimitResponse)
                for worker_id, request in enumerate(requests):
                    self._send(worker_id, request, heal=resendable)
                answers = [
                    self._await(worker_id, expected, expected.__name__, request if resendable else None)
                    for worker_id, request in enumerate(requests)
                ]
            except BaseException as e:
                if self.broken is None:
                    self.broken = f"{type(e).__name__} during {expected.__name__}"
                raise
            for answer in answers:
                if isinstance(answer, ErrorResponse):
                    answer.exc.reraise()
            return answers

    def _send(self, worker_id: int, request: Any, heal: bool) -> None:
        """Send ``request``; a worker found dead is replaced first if ``heal`` allows it."""
        try:
            self.channels[worker_id].send(request)
        except WorkerDiedError as e:
            if not (heal and self._may_heal(worker_id)):
                raise
            self._heal(worker_id, e)
            self.channels[worker_id].send(request)

    def _check_open(self) -> None:
        if self.closed:
            raise ReadingServiceClosedError("the reading service was shut down; its workers are gone")
        self._check_not_broken()

    def _check_not_broken(self) -> None:
        if self.broken is not None:
            raise ReadingServiceError(
                f"the reading service cannot continue after an interrupted exchange with its workers "
                f"({self.broken}): a message may be lost. Shut it down and restore the last checkpoint."
            )

    def reset_epoch(
        self, epoch: int, seed_generators: Sequence[Any], iter_reset_fn: Optional[Callable]
    ) -> None:
        """Reset every worker to ``epoch``; everything still in flight from before is dropped.

        The workers produce nothing until :meth:`start_epoch` grants them credit, so that the
        dispatching process (if any) can be reset, and a restore replayed, in between.
        """
        with self.lock:
            self._check_open()
            self.epoch = epoch  # from here on, responses of older epochs are stale
            self._epoch_seeds, self._epoch_iter_reset_fn = seed_generators, iter_reset_fn
            self.restarts = [0] * self.num_workers
            self.request_all(
                lambda i: ResetEpochRequest(epoch, seed_generators[i], iter_reset_fn), ResetEpochResponse
            )
            self._set_positions([WorkerPosition()] * self.num_workers, next_worker=0)

    def replay(self, positions: Sequence[WorkerPosition], next_worker: int) -> None:
        """Restore: worker ``i`` replays (and drops) the ``positions[i].delivered`` items the user
        already had, checking their running digest, starting from its recorded graph state if it has one;
        the round-robin resumes at ``next_worker``. Workers whose stream had ended are found
        again on the way, at the same places."""
        with self.lock:
            self.request_all(lambda i: _replay_request(self.epoch, positions[i]), ReplayResponse)
            self._set_positions(positions, next_worker)

    def _set_positions(self, positions: Sequence[WorkerPosition], next_worker: int) -> None:
        for worker_id, position in enumerate(positions):
            self.buffers[worker_id].clear()
            self.digests[worker_id].clear()
            if position.digest is not None:  # the digest at the restored position, as if received
                self.digests[worker_id].append((position.delivered, _pack_digest(position.digest)))
            self.states[worker_id].clear()
            self.best_states[worker_id] = position.state
            done = position.delivered
            self.received[worker_id] = self.delivered[worker_id] = done
            self.credits[worker_id] = Credit(self.window, granted=done)
            self.exhausted[worker_id] = False
        self.next_worker = next_worker

    def start_epoch(self) -> None:
        """Grant every worker its first credit window: production of the epoch starts."""
        with self.lock:
            for worker_id in range(self.num_workers):
                self._top_up(worker_id)

    def position_state(self, worker_id: int, position: int) -> Optional[GraphState]:
        """The latest graph state of worker ``worker_id`` captured strictly before ``position``:
        a restore from it replays, and checks, at least the item at ``position``. Older states
        are dropped (positions only grow)."""
        with self.lock:
            pending = self.states[worker_id]
            while pending and pending[0][0] < position:
                self.best_states[worker_id] = pending.popleft()
            return self.best_states[worker_id]

    def position_digest(self, worker_id: int, position: int) -> Optional[str]:
        """Worker ``worker_id``'s running digest after its ``position``-th item, if kept."""
        with self.lock:
            for first, packed in self.digests[worker_id]:
                index = position - first
                if 0 <= index < len(packed) // _DIGEST_SIZE:
                    return chain_hex(array("Q", packed[index * _DIGEST_SIZE : (index + 1) * _DIGEST_SIZE])[0])
            return None

    def _prune_digests(self, worker_id: int, position: int) -> None:
        """Drop the batches of digests that end before ``position`` (positions only grow)."""
        batches = self.digests[worker_id]
        while len(batches) > 1 and batches[0][0] + len(batches[0][1]) // _DIGEST_SIZE <= position:
            batches.popleft()

    def _kept_position(self, worker_id: int) -> int:
        """How far back digests and states of worker ``worker_id`` may still be asked for: the
        user's position when it is tracked (checkpoints), else what this process received
        (self-healing only needs that), so neither list grows with the epoch."""
        if self.user_position is not None:
            return self.user_position[worker_id]
        return self.received[worker_id]

    def request_pause(self, pause_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        self.request_all(lambda i: PauseRequest(pause_fn), PauseResponse)
        self.paused = True

    def request_resume(self, resume_fn: Optional[Callable[[DataPipe], DataPipe]] = None) -> None:
        self.request_all(lambda i: ResumeRequest(resume_fn), ResumeResponse)
        self.paused = False

    # --- self-healing ---------------------------------------------------------------------------

    def _may_heal(self, worker_id: int) -> bool:
        return self.respawn is not None and self.epoch >= 0 and not self.closed

    def _heal(self, worker_id: int, death: WorkerDiedError) -> None:
        """Replace dead worker ``worker_id`` by a new process that replays, inside itself, the
        ``received[worker_id]`` items this process already has, then streams on: the data is
        exactly what the dead worker would have sent. Bounded by ``restarts_allowed``."""
        self.restarts[worker_id] += 1
        if self.restarts[worker_id] > self.restarts_allowed:
            self.broken = f"worker {worker_id} died {self.restarts[worker_id]} times this epoch"
            raise WorkerDiedError(
                f"{death} (it was restarted {self.restarts_allowed} times this epoch already: giving up)"
            ) from death
        assert self.respawn is not None
        self.channels[worker_id].close()
        channel = self.respawn(worker_id)
        self.channels[worker_id] = channel
        position = self.received[worker_id]
        behind = [s for s in [self.best_states[worker_id], *self.states[worker_id]] if s and s[0] < position]
        state = max(behind, key=lambda s: s[0], default=None)
        there = WorkerPosition(position, self.position_digest(worker_id, position), state)
        reset = ResetEpochRequest(self.epoch, self._epoch_seeds[worker_id], self._epoch_iter_reset_fn)
        steps: List[Tuple[Any, Type[Any]]] = [
            (reset, ResetEpochResponse),
            (_replay_request(self.epoch, there), ReplayResponse),
        ]
        if self.paused:
            steps.append((PauseRequest(), PauseResponse))
        try:
            for request, expected in steps:
                channel.send(request)
                while True:
                    answer = channel.recv(
                        self.control_timeout_s, what=f"{expected.__name__} of a restarted worker"
                    )
                    if isinstance(answer, ErrorResponse):
                        answer.exc.reraise()
                    if isinstance(answer, expected):
                        break
            outstanding = self.credits[worker_id].granted - position
            if outstanding > 0:
                channel.send(GetNextRequest(self.epoch, outstanding))
        except BaseException as e:
            self.broken = f"restarting worker {worker_id} failed: {type(e).__name__}: {e}"
            raise

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

        self.request_all(limit, LimitResponse)

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

        with self.lock:
            responses = self.request_all(get_state, GetStateResponse)
            return [self._complete(worker_id, r.snapshot) for worker_id, r in enumerate(responses)]

    def _complete(self, worker_id: int, snap: WorkerSnapshot) -> WorkerSnapshot:
        from dataclasses import replace

        return replace(
            snap,
            received=self.received[worker_id],
            handed_on=self.delivered[worker_id],
            buffered_in_main=self.received[worker_id] - self.delivered[worker_id],
        )

    def request_terminate(self, timeout_s: float) -> bool:
        """Ask every worker to stop and read up to its answer (bounded). Idempotent.

        Items still in flight are read and dropped (tensors in them are released). Returns
        whether every worker said goodbye; if not (a worker is dead or stuck, the pipes cannot be
        trusted, or another thread is in the middle of an exchange) the caller kills them.
        """
        if not self.lock.acquire(timeout=TERMINATE_LOCK_WAIT_S):
            # Another thread is mid-exchange (a snapshot, a read in a tail's thread): it will
            # see ReadingServiceClosedError once the processes are killed.
            self.closed = True
            return False
        try:
            return self._terminate(timeout_s)
        finally:
            self.lock.release()

    def _terminate(self, timeout_s: float) -> bool:
        if self.closed:
            return True
        self.closed = True
        if self.broken is not None:
            return False  # the pipes cannot be trusted
        self.epoch = CLOSED_EPOCH  # whatever is still in flight is stale
        asked = []
        for worker_id, channel in enumerate(self.channels):
            try:
                channel.send(TerminateRequest())
                asked.append(worker_id)
            except Exception:
                pass  # dead already: the caller kills and joins what is left
        # One deadline for all: workers stuck in user code cost timeout_s in total, not each.
        deadline = time.monotonic() + timeout_s
        said_goodbye = 0
        for worker_id in asked:
            try:
                while not isinstance(
                    self._read(worker_id, max(0.0, deadline - time.monotonic()), "TerminateResponse"),
                    TerminateResponse,
                ):
                    pass
                said_goodbye += 1
            except Exception:
                pass
        for buffer in self.buffers:
            buffer.clear()
        return said_goodbye == self.num_workers


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
