r"""Helpers over a DataPipe graph: its DataPipes with stable keys, their yield counts and
``state_dict()``\ s, pausing the ones with threads, naming them in messages."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from torchdata.dataloader2.graph import DataPipe, list_dps, traverse_dps

from torchdata_snapshot._compat import prefetcher_in_progress, samples_yielded
from torchdata_snapshot._constants import PREFETCHER_PAUSE_CHECK_S
from torchdata_snapshot._errors import StateCaptureError

__all__ = [
    "datapipe_key",
    "datapipe_state_dicts",
    "datapipe_yields",
    "describe_datapipe",
    "graph_datapipes",
    "pausable",
    "paused",
]


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


def pause_datapipe(dp: DataPipe) -> None:
    """``dp.pause()``, except that pausing torchdata's ``Prefetcher`` cannot hang.

    Upstream's ``Prefetcher.pause()`` waits until its thread reports that it stopped producing.
    A thread whose source has just ended reports it once and then exits: after a ``resume()``
    (which clears the report) within those last milliseconds, the next ``pause()`` waited forever
    (upstream's own ``test_reading_service_limit`` with ``prefetch().prefetch()`` over 10 items
    hit it). A thread that has ended, or whose source has ended, produces nothing more: it is
    paused as well.
    """
    progress = prefetcher_in_progress(dp)
    if progress is None:
        dp.pause()
        return
    data, thread = progress
    data.run_prefetcher = False
    while not (data.paused or data.stop_iteration) and thread.is_alive():
        thread.join(PREFETCHER_PAUSE_CHECK_S)


@contextmanager
def paused(datapipes: Sequence[DataPipe]) -> Iterator[None]:
    """Pause ``datapipes`` (see :func:`pausable`) around a block, resume them in reverse order."""
    for dp in datapipes:
        pause_datapipe(dp)
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


def datapipe_state_dicts(datapipes: List[Tuple[str, DataPipe]]) -> Dict[str, Any]:
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
