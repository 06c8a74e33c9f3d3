"""``WorkerSnapshot``: what ``MultiProcessingReadingService.snapshot()`` reports for each process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Tuple

__all__ = ["Role", "WorkerSnapshot"]

#: What process a snapshot describes.
Role = Literal["worker", "dispatcher", "in_process"]


@dataclass(frozen=True)
class WorkerSnapshot:
    """The state of one worker (or of the dispatching process) at one consistent point.

    A snapshot is taken while the process's DataPipes are paused, and the main process reads
    every item the worker had produced before it answered, so the counts add up:

    * ``produced == sent + buffered`` (inside the worker: ``buffered`` items were still in its
      outbox when it answered; they travel ahead of the answer);
    * ``received == produced`` (the main process has read all of them);
    * ``received == handed_on + buffered_in_main`` (main process).

    For the dispatching process (``role == "dispatcher"``, ``worker_id == -1``) ``sent`` counts the
    items dispatched to all workers, ``sent_per_worker`` splits them by worker, ``buffered`` counts
    items produced but not yet sent, and the main-process fields are ``0``.

    Attributes:
        worker_id: the worker's id (``0 .. num_workers - 1``); ``-1`` for the dispatcher.
        role: ``"worker"``, ``"dispatcher"`` or ``"in_process"`` (``num_workers=0``).
        pid: the process id.
        epoch: number of the current epoch (``0`` for the first one, ``-1`` before any).
        produced: items the process's DataPipe graph produced this epoch.
        sent: items handed to the main process this epoch.
        batches: messages those items travelled in (``sent / batches`` items per message).
        buffered: items produced but not yet written to the main process's pipe.
        received: items the main process has received from this worker this epoch.
        handed_on: items the main process has handed on (to the user, or to the DataPipes that
            run in the main process after the workers' part of the graph).
        buffered_in_main: items received by the main process and not yet handed on.
        exhausted: the worker's graph reached ``StopIteration`` this epoch.
        paused: the process is paused (``limit`` / ``_pause``).
        datapipe_yields: per-DataPipe count of yielded items, keyed by ``datapipe_key``.
        datapipe_states: ``state_dict()`` of each DataPipe that has one, same keys.
        sent_per_worker: dispatcher only: items dispatched to each worker.
        received_from_dispatcher: worker only, with a dispatching process: items received from
            it this epoch; equal to the dispatcher's ``sent_per_worker[worker_id]`` in a snapshot.
        stateful: the worker's graph resumes from captured states (restore time independent of
            the position); otherwise a restore replays its stream.
    """

    worker_id: int
    role: Role
    pid: int
    epoch: int
    produced: int
    sent: int
    buffered: int
    batches: int = 0
    received: int = 0
    handed_on: int = 0
    buffered_in_main: int = 0
    exhausted: bool = False
    paused: bool = False
    datapipe_yields: Dict[str, int] = field(default_factory=dict)
    datapipe_states: Dict[str, Any] = field(default_factory=dict)
    sent_per_worker: Tuple[int, ...] = ()
    received_from_dispatcher: int = 0
    stateful: bool = False
