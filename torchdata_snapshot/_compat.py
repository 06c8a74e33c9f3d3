"""Every private torch and torchdata API this package relies on, in one place.

DataLoader2's extension points cover most of what a reading service needs, but not all of it:
the fields a restore sets on a ``DataLoader2``, the graph's serialization wrapper, its
replicable-branch search, the dispatching placeholder, the worker-side init and reset functions,
the counters torch keeps on every DataPipe, the fields of a few DataPipes and of
``SeedGenerator``; and one registry of ``multiprocessing``.
Each is reached through a name below, so that a torch or torchdata release that moves one
breaks one line here, and the tests of this package (which run on every supported torchdata)
say which.

Checked against torch 2.13 and torchdata 0.7.1, 0.8.0 and 0.9.0.
"""

from __future__ import annotations

import pickle
import sys
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Type, cast

from torch.utils.data import IterDataPipe as _TorchIterDataPipe
from torch.utils.data.datapipes.iter.combinatorics import ShufflerIterDataPipe
from torch.utils.data.datapipes.iter.grouping import UnBatcherIterDataPipe
from torch.utils.data.datapipes.utils.common import get_file_pathnames_from_root
from torchdata._utils import ExceptionWrapper as _TorchdataExceptionWrapper
from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.graph._serialization import attach_wrapper, extract_wrapper
from torchdata.dataloader2.graph.utils import _find_replicable_branches
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils.dispatch import (
    _DummyIterDataPipe,
    find_lca_round_robin_sharding_dp,
    find_non_dispatching_branches,
)
from torchdata.datapipes.iter import Decompressor as DecompressorIterDataPipe
from torchdata.datapipes.iter import FlatMapper as FlatMapperIterDataPipe
from torchdata.datapipes.iter import Prefetcher as PrefetcherIterDataPipe
from torchdata.datapipes.iter.util.randomsplitter import _RandomSplitterIterDataPipe
from torchdata.datapipes.iter.util.webdataset import pathsplit

from torchdata_snapshot._errors import ReadingServiceError

__all__ = [
    "compression_type",
    "dataloader2_reading_service_state",
    "dataloader2_started",
    "decompressor_of",
    "DispatchPlaceholder",
    "ExceptionWrapper",
    "RandomSplitterIterDataPipe",
    "RemoteTraceback",
    "attach_wrapper",
    "extract_wrapper",
    "find_lca_round_robin_sharding_dp",
    "find_non_dispatching_branches",
    "find_replicable_branches",
    "flatmap_expand",
    "get_file_pathnames_from_root",
    "iterator_id",
    "load_dataloader2_state",
    "load_seed_engine_states",
    "unhooked_iter",
    "prefetcher_in_progress",
    "samples_yielded",
    "seed_engine_states",
    "shuffler_settings",
    "text_reader_setting",
    "unbatch_dive",
    "webdataset_pathsplit",
]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process (or thread): the cause of the
    exception re-raised from it in this one."""


class ExceptionWrapper(_TorchdataExceptionWrapper):
    """``torchdata._utils.ExceptionWrapper``: an exception raised in a worker (or a thread), which
    its ``reraise()`` raises in the main process. An exception of the user's pipeline is re-raised
    as torchdata does (its type, its message ``Caught ValueError in worker process 1.`` followed by
    the worker's traceback). One of this package's (a :class:`ReadingServiceError`, such as
    ``ChangedFileError``: its message says what happened and what to do) is re-raised with that
    message only, the worker's traceback as its cause (``raise ... from``), so that the last
    line a user reads is the message, not the worker's frames."""

    def __init__(self, exc_info: Any = None, where: str = "in background") -> None:
        exc_info = sys.exc_info() if exc_info is None else exc_info
        super().__init__(exc_info, where)
        exception = exc_info[1]
        self.message = _own_message(exception) if isinstance(exception, ReadingServiceError) else None

    def reraise(self) -> None:
        message = getattr(self, "message", None)  # (None: an exception of the user's)
        if message is None:
            super().reraise()
        cause = RemoteTraceback(f"{self.exc_type.__name__} {self.where}:\n{self.exc_msg}")
        raise self.exc_type(message) from cause


#: What torch's iterator hook appends to the message of an exception raised in a DataPipe's
#: ``__iter__``, naming it (``This exception is thrown by __iter__ of MapperIterDataPipe(...)``).
_HOOK_NOTE = "\nThis exception is thrown by "


def _own_message(exception: BaseException) -> str:
    """``exception``'s message as it was raised, without the notes torch's hook appended."""
    return str(exception).split(_HOOK_NOTE, 1)[0]


#: The placeholder DataLoader2 puts where the dispatched part of a graph was; typed as torch's
#: IterDataPipe, which ``find_dps`` expects (torchdata's generated stubs declare their own).
DispatchPlaceholder = cast(Type[_TorchIterDataPipe], _DummyIterDataPipe)

#: The DataPipe ``random_split`` shares between its outputs (its ``weights`` are those left in
#: the epoch: they change as it draws).
RandomSplitterIterDataPipe = _RandomSplitterIterDataPipe


def compression_type(decompressor: DecompressorIterDataPipe, path: str) -> str:
    """The name of the compression torchdata's ``Decompressor`` applies to the file at ``path``."""
    return str(decompressor._detect_compression_type(path).value)


def decompressor_of(file_type: str) -> Callable[[Any], Any]:
    """``Decompressor``'s function for the compression named ``file_type``."""
    return DecompressorIterDataPipe._DECOMPRESSORS[DecompressorIterDataPipe.types(file_type)]


#: ``WebDataset``'s split of a member's path into ``(key, extension)``.
webdataset_pathsplit: Callable[[str], Tuple[str, str]] = pathsplit


def find_replicable_branches(graph: Any) -> List[DataPipe]:
    """The roots of the graph's branches that may run in every worker."""
    return _find_replicable_branches(graph)


def samples_yielded(dp: DataPipe) -> int:
    """How many items ``dp``'s current iterator yielded (torch counts them on every DataPipe)."""
    return int(getattr(dp, "_number_of_samples_yielded", 0))


def iterator_id(dp: DataPipe) -> Optional[int]:
    """The number torch gave ``dp``'s latest iterator (``None`` before the first): it moves
    whenever an iteration of ``dp`` starts."""
    return getattr(dp, "_valid_iterator_id", None)


def shuffler_settings(dp: ShufflerIterDataPipe) -> Tuple[bool, Optional[int]]:
    """``(enabled, seed for the next iteration)`` of torchdata's ``Shuffler``."""
    return dp._enabled, dp._seed


def text_reader_setting(dp: DataPipe, name: str) -> Any:
    """Constructor argument ``name`` (``strip_newline``, ``encoding``, ...) of torchdata's
    ``LineReader``, ``CSVParser`` or ``CSVDictParser``: they keep them in a private helper."""
    return getattr(dp._helper, f"_{name}")


#: ``UnBatcher``'s expansion of one element, borrowed as a method by a class with an
#: ``unbatch_level`` attribute: ``self._dive(element, unbatch_level=...)``.
unbatch_dive: Callable[..., Iterator[Any]] = UnBatcherIterDataPipe._dive


def flatmap_expand(dp: FlatMapperIterDataPipe) -> Callable[[Any, Any], Iterable[Any]]:
    """``FlatMapper``'s per-element function (``input_col`` handling included), called
    as ``fn(holder, element)`` where ``holder`` has ``fn`` and ``input_col``."""
    return type(dp)._apply_fn


#: The two Philox engines of a ``SeedGenerator``: its shared stream and its per-process stream.
_SEED_ENGINES = (("shared", "_shared_rng"), ("worker", "_worker_rng"))


def seed_engine_states(generator: SeedGenerator) -> Dict[str, Dict[str, Any]]:
    """``{"shared": fields, "worker": fields}``: each engine's ``seed``, ``ctr``, ``generated``
    (cached draws, or ``None``) and ``spawn_seed``, as ``SeedGenerator`` keeps them."""
    states = {}
    for key, name in _SEED_ENGINES:
        engine = getattr(generator, name)
        states[key] = {
            "seed": engine._seed,
            "ctr": engine._ctr,
            "generated": engine._generated_seeds,
            "spawn_seed": engine._spawn_seed,
        }
    return states


def load_seed_engine_states(generator: SeedGenerator, states: Dict[str, Dict[str, Any]]) -> None:
    """Set ``generator``'s engines, in place, to fields as :func:`seed_engine_states` returns them."""
    for key, name in _SEED_ENGINES:
        engine, fields = getattr(generator, name), states[key]
        engine._seed = tuple(fields["seed"])
        engine._ctr = list(fields["ctr"])
        engine._generated_seeds = None if fields["generated"] is None else list(fields["generated"])
        engine._spawn_seed = tuple(fields["spawn_seed"])


def prefetcher_in_progress(dp: DataPipe) -> Optional[Tuple[Any, threading.Thread]]:
    """``(prefetch_data, thread)`` of a torchdata ``Prefetcher`` (or ``PinMemory``) that is
    iterating: ``prefetch_data`` has the flags ``run_prefetcher``, ``paused`` (set by the thread
    once it stopped producing) and ``stop_iteration`` (set once its source ended). Else ``None``."""
    if not isinstance(dp, PrefetcherIterDataPipe):
        return None
    data, thread = getattr(dp, "prefetch_data", None), getattr(dp, "thread", None)
    return None if data is None or thread is None else (data, thread)


def unhooked_iter(cls: type, iter_fn: Callable[[Any], Iterator[Any]]) -> None:
    """Make ``iter_fn`` the ``__iter__`` of the DataPipe class ``cls`` without torch's hook.

    The DataPipe metaclass wraps every ``__iter__`` defined in a class body: each ``next()``
    then checks that the iterator is still the DataPipe's valid one, looks at the profiler and
    counts the item, about 1 us per item, a fifth of a tiny item's whole cost in process. An
    ``__iter__`` set once the class exists is not wrapped; the class must then check its own
    iterators' validity and count its own items.
    """
    cls.__iter__ = iter_fn  # type: ignore[attr-defined]


get_file_pathnames_from_root = get_file_pathnames_from_root


def shared_memory_types() -> Dict[type, Any]:
    """The types ``ForkingPickler.register`` was given a reduction for: torch registers tensors
    and storages, which then travel through shared memory. Registering updates this same dict,
    so a reference taken before ``import torch`` stays current."""
    return ForkingPickler._extra_reducers  # type: ignore[attr-defined]


# --- DataLoader2's restore fields ---------------------------------------------------------------


def dataloader2_started(dataloader: Any) -> bool:
    """Whether ``dataloader`` was iterated (its reading service initialized) or shut down: a state
    loaded then would never reach its reading service."""
    return bool(dataloader._adapted or dataloader._datapipe_iter is not None or dataloader._terminated)


def dataloader2_reading_service_state(state: Any) -> Any:
    """The reading service's part of a ``DataLoader2.state_dict()``; ``KeyError`` if it has none."""
    # Imported here: in torchdata's tree this module loads while dataloader2.py is being imported.
    from torchdata.dataloader2.dataloader2 import READING_SERVICE_STATE_KEY_NAME

    return state[READING_SERVICE_STATE_KEY_NAME]


def load_dataloader2_state(dataloader: Any, reading_service_state: Any, state: Dict[str, Any]) -> None:
    """What ``DataLoader2.load_state_dict(state)`` does, but for the pipeline: ``dataloader``'s
    first ``iter()`` restores ``reading_service_state`` into its reading service, with the seeds
    ``state`` recorded (when it has them: torchdata >= 0.7), and ``state_dict()`` returns ``state``
    until then (torchdata >= 0.8 caches it). The pipeline ``state`` pickled is not read."""
    from torchdata.dataloader2.dataloader2 import RANDOMNESS_STATE_KEY_NAME  # see above

    dataloader.reading_service_state = reading_service_state
    randomness = state.get(RANDOMNESS_STATE_KEY_NAME)
    if randomness is not None:
        dataloader._seed, dataloader._reset_seed = randomness[0], randomness[1]
        dataloader._seed_generator = pickle.loads(randomness[2])
        dataloader._initial_seed_generator = pickle.loads(randomness[3])
    if hasattr(dataloader, "_state_dict"):
        dataloader._state_dict = state
