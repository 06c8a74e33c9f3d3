"""``WorkerSnapshot``: what ``MultiProcessingReadingService.snapshot()`` reports for each process."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from torchdata.dataloader2.graph import DataPipe, list_dps, traverse_dps

from torchdata_snapshot._compat import samples_yielded
from torchdata_snapshot._errors import StateCaptureError

__all__ = [
    "WorkerSnapshot",
    "capture_datapipe_states",
    "datapipe_key",
    "datapipe_yields",
    "describe_datapipe",
    "graph_datapipes",
    "pausable",
    "paused",
]


@dataclass(frozen=True)
class WorkerSnapshot:
    """The state of one worker (or of the dispatching process) at one consistent point.

    A snapshot is taken while the process's DataPipes are paused, and the main process reads
    every item the worker had produced before it answered, so the counts add up:

    * ``produced == sent + buffered`` (inside the worker: ``buffered`` items were still in its
      outbox when it answered; they travel ahead of the answer);
    * ``received == produced`` (the main process has read all of them);
    * ``received == delivered + buffered_in_main`` (main process).

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
        delivered: items the main process has handed on (to the user or the main-process tail).
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
    role: str
    pid: int
    epoch: int
    produced: int
    sent: int
    buffered: int
    batches: int = 0
    received: int = 0
    delivered: int = 0
    buffered_in_main: int = 0
    exhausted: bool = False
    paused: bool = False
    datapipe_yields: Dict[str, int] = field(default_factory=dict)
    datapipe_states: Dict[str, Any] = field(default_factory=dict)
    sent_per_worker: Tuple[int, ...] = ()
    received_from_dispatcher: int = 0
    stateful: bool = False


def datapipe_key(index: int, datapipe: DataPipe) -> str:
    """Stable name of a DataPipe in its graph: breadth-first index from the output, and type."""
    return f"{index}:{type(datapipe).__name__}"


def graph_datapipes(datapipe: DataPipe) -> List[Tuple[str, DataPipe]]:
    """All DataPipes of the graph ending at ``datapipe``, output first, with their keys."""
    return [(datapipe_key(i, dp), dp) for i, dp in enumerate(list_dps(traverse_dps(datapipe)))]


def datapipe_yields(graph: List[Tuple[str, DataPipe]]) -> Dict[str, int]:
    """How many items each DataPipe of ``graph`` yielded this epoch (upstream's own counter)."""
    return {key: samples_yielded(dp) for key, dp in graph}


def pausable(datapipes: Iterable[DataPipe]) -> List[DataPipe]:
    """The DataPipes with ``pause()``/``resume()`` (those running threads of their own), in order."""
    return [dp for dp in datapipes if callable(getattr(dp, "pause", None))]


@contextmanager
def paused(datapipes: Sequence[DataPipe]) -> Iterator[None]:
    """Pause ``datapipes`` (see :func:`pausable`) around a block, resume them in reverse order."""
    for dp in datapipes:
        dp.pause()
    try:
        yield
    finally:
        for dp in reversed(datapipes):
            dp.resume()


def describe_datapipe(datapipe: DataPipe) -> str:
    """The DataPipe's class, as error messages name it."""
    return f"{type(datapipe).__module__}.{type(datapipe).__qualname__}"


def _find_unpicklable(state: Any) -> Optional[str]:
    """The key path of the first part of ``state`` that does not pickle, if any."""
    if isinstance(state, dict):
        for key, value in state.items():
            try:
                pickle.dumps(value)
            except Exception:
                inner = _find_unpicklable(value)
                return repr(key) + ("" if inner is None else f" -> {inner}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            try:
                pickle.dumps(value)
            except Exception:
                inner = _find_unpicklable(value)
                return f"[{i}]" + ("" if inner is None else f" -> {inner}")
    return None


def capture_datapipe_states(datapipes: List[Tuple[str, DataPipe]]) -> Dict[str, Any]:
    """``state_dict()`` of every DataPipe that has one, checked to be picklable.

    Raises :class:`StateCaptureError` naming the DataPipe (and the unpicklable attribute).
    """
    states: Dict[str, Any] = {}
    for key, dp in datapipes:
        state_dict = getattr(dp, "state_dict", None)
        if not callable(state_dict):
            continue
        try:
            state = state_dict()
        except Exception as e:
            raise StateCaptureError(
                f"state_dict() of DataPipe {key} ({describe_datapipe(dp)}) raised {type(e).__name__}: {e}"
            ) from e
        try:
            pickle.dumps(state)
        except Exception as e:
            where = _find_unpicklable(state)
            attribute = "" if where is None else f" (attribute {where})"
            raise StateCaptureError(
                f"the state of DataPipe {key} ({describe_datapipe(dp)}) cannot be pickled{attribute}: "
                f"{type(e).__name__}: {e}"
            ) from e
        states[key] = state
    return states
