r"""Helpers over a DataPipe graph: its DataPipes with stable keys, their yield counts and
``state_dict()``\ s, pausing the ones with threads, naming them and their functions in messages,
plain data (what ``_arguments`` records of their constructor arguments)."""

from __future__ import annotations

import json
import pickle
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, cast

from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe
from torchdata.dataloader2.graph import DataPipe, DataPipeGraph, find_dps, list_dps

from torchdata_snapshot._compat.datapipes import prefetcher_in_progress, samples_yielded
from torchdata_snapshot._constants import PREFETCHER_PAUSE_CHECK_S
from torchdata_snapshot._errors import StateCaptureError
from torchdata_snapshot.core.traversal import traverse

__all__ = [
    "FUNCTION_ATTRIBUTES",
    "NOT_PLAIN",
    "datapipe_key",
    "datapipe_state_dicts",
    "datapipe_yields",
    "describe_datapipe",
    "function_name",
    "graph_datapipes",
    "pausable",
    "paused",
    "plain_data",
    "sharding_layout",
    "sharding_point",
]


def datapipe_key(index: int, datapipe: DataPipe) -> str:
    """Stable name of a DataPipe in its graph: breadth-first index from the output, and type."""
    return f"{index}:{type(datapipe).__name__}"


def graph_datapipes(datapipe: DataPipe, graph: Optional[DataPipeGraph] = None) -> List[Tuple[str, DataPipe]]:
    """All DataPipes of the graph ending at ``datapipe`` (``graph``, if the caller traversed it
    already), output first, with their keys."""
    graph = traverse(datapipe) if graph is None else graph
    return [(datapipe_key(i, dp), dp) for i, dp in enumerate(list_dps(graph))]


def datapipe_yields(graph: List[Tuple[str, DataPipe]]) -> Dict[str, int]:
    """How many items each DataPipe of ``graph`` yielded this epoch (torchdata's own counter); a
    MapDataPipe keeps none, and is absent."""
    return {key: samples_yielded(dp) for key, dp in graph if isinstance(dp, IterDataPipe)}


def pausable(datapipes: Iterable[DataPipe]) -> List[DataPipe]:
    """The DataPipes with ``pause()``/``resume()`` (those running threads of their own), in order."""
    return [dp for dp in datapipes if callable(getattr(dp, "pause", None))]


def pause_datapipe(dp: DataPipe) -> None:
    """``dp.pause()``, except that pausing torchdata's ``Prefetcher`` cannot hang.

    ``Prefetcher.pause()`` waits until its thread reports that it stopped producing.
    A thread whose source has just ended reports it once and then exits: after a ``resume()``
    (which clears the report) within those last milliseconds, the next ``pause()`` waited forever
    (test_mprs.py's ``test_reading_service_limit`` with ``prefetch().prefetch()`` over 10 items
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


#: The attributes in which torch's DataPipes keep the function they apply (``map``, ``filter``).
FUNCTION_ATTRIBUTES = ("fn", "filter_fn")

_SCALARS = (type(None), bool, int, float, str)

#: What :func:`plain_data` returns for a value that is not plain data (``None`` is).
NOT_PLAIN = object()


def function_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, as fingerprints and messages name it."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def plain_data(value: Any, max_chars: int) -> Any:
    """``value`` as plain data, JSON's types (``None``, bools, ints, floats, strings, lists, dicts
    with string keys; tuples become lists), if it is that and at most ``max_chars`` long as
    JSON; else :data:`NOT_PLAIN`. Subclasses (an ``IntEnum``) are not plain data."""
    plain = _plain(value, [max_chars])
    return NOT_PLAIN if plain is NOT_PLAIN or len(json.dumps(plain)) > max_chars else plain


def _plain(value: Any, budget: List[int]) -> Any:
    """:func:`plain_data` without the length check. Every value visited costs one of
    ``budget[0]`` (each takes at least a character of JSON): a long or self-containing value
    runs out of it instead of being walked whole."""
    budget[0] -= 1
    if budget[0] < 0:
        return NOT_PLAIN
    if type(value) in _SCALARS:
        return value
    if type(value) in (list, tuple, dict) and len(value) > budget[0]:
        return NOT_PLAIN
    if type(value) in (list, tuple):
        items = [_plain(item, budget) for item in value]
        return NOT_PLAIN if any(item is NOT_PLAIN for item in items) else items
    if type(value) is dict and all(type(key) is str for key in value):
        entries = {key: _plain(item, budget) for key, item in value.items()}
        return NOT_PLAIN if any(item is NOT_PLAIN for item in entries.values()) else entries
    return NOT_PLAIN


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


def sharding_point(
    datapipe: DataPipe, graph: Optional[DataPipeGraph] = None
) -> Optional[ShardingFilterIterDataPipe]:
    """The graph's one sharding filter, or ``None`` if it has none or several (``graph``: as in
    :func:`graph_datapipes`)."""
    found = find_dps(traverse(datapipe) if graph is None else graph, ShardingFilterIterDataPipe)
    return cast(ShardingFilterIterDataPipe, found[0]) if len(found) == 1 else None


def sharding_layout(sf: ShardingFilterIterDataPipe) -> Tuple[int, int]:
    """``(world_size, rank)`` that ``DistributedReadingService`` gave the filter (``(1, 0)``
    without one)."""
    return tuple(sf.groups.get(SHARDING_PRIORITIES.DISTRIBUTED, (1, 0)))  # type: ignore[return-value]
