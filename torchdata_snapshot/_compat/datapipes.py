"""The fields of DataPipes the reading service reads: the counters torch keeps on every DataPipe,
its iterator hook, and what a few DataPipes of torchdata keep to themselves (a ``Decompressor``'s
detection, the text readers' arguments, a ``Prefetcher``'s thread)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

from torch.utils.data import IterDataPipe
from torch.utils.data.graph import DataPipe
from torchdata.datapipes.iter import Decompressor as DecompressorIterDataPipe
from torchdata.datapipes.iter import Prefetcher as PrefetcherIterDataPipe


def samples_yielded(dp: DataPipe) -> int:
    """How many items ``dp``'s current iterator yielded (torch counts them on every DataPipe)."""
    return int(getattr(dp, "_number_of_samples_yielded", 0))


def iterator_id(dp: DataPipe) -> Optional[int]:
    """The number torch gave ``dp``'s latest iterator (``None`` before the first): it moves
    whenever an iteration of ``dp`` starts."""
    return getattr(dp, "_valid_iterator_id", None)


def answer_child_checks(datapipes: Iterable[DataPipe]) -> None:
    """Answer once, on each of ``datapipes``, the question torch's iterator hook asks of every
    IterDataPipe at every item: ``hasattr(dp, "_is_child_datapipe")``.

    Only a ``fork()``/``demux()`` child's class has that attribute. On any other DataPipe the
    lookup falls through to ``IterDataPipe.__getattr__``, which formats and raises an
    ``AttributeError`` for ``hasattr`` to catch: about 0.9 us per DataPipe per item, 3.5 of the
    5.6 us a tiny item costs a graph of four. ``False`` in the instance is the answer the hook
    reached anyway: it then checks the iterator as a plain DataPipe's, as before. DataPipes
    whose class answers (children) are left as they are.
    """
    for dp in datapipes:
        if isinstance(dp, IterDataPipe) and getattr(type(dp), "_is_child_datapipe", None) is None:
            vars(dp)["_is_child_datapipe"] = False


def unhooked_iter(cls: type, iter_fn: Callable[[Any], Iterator[Any]]) -> None:
    """Make ``iter_fn`` the ``__iter__`` of the DataPipe class ``cls`` without torch's hook.

    The DataPipe metaclass wraps every ``__iter__`` defined in a class body: each ``next()``
    then checks that the iterator is still the DataPipe's valid one, looks at the profiler and
    counts the item, about 1 us per item, a fifth of a tiny item's whole cost in process. An
    ``__iter__`` set once the class exists is not wrapped; the class must then check its own
    iterators' validity and count its own items.
    """
    cls.__iter__ = iter_fn  # type: ignore[attr-defined]


def compression_type(decompressor: DecompressorIterDataPipe, path: str) -> str:
    """The name of the compression ``Decompressor`` applies to the file at ``path``."""
    return str(decompressor._detect_compression_type(path).value)


def decompressor_of(file_type: str) -> Callable[[Any], Any]:
    """``Decompressor``'s function for the compression named ``file_type``."""
    return DecompressorIterDataPipe._DECOMPRESSORS[DecompressorIterDataPipe.types(file_type)]


def text_reader_setting(dp: DataPipe, name: str) -> Any:
    """Constructor argument ``name`` (``strip_newline``, ``encoding``, ...) of ``LineReader``,
    ``CSVParser`` or ``CSVDictParser``: they keep them in a private helper."""
    return getattr(dp._helper, f"_{name}")


def prefetcher_in_progress(dp: DataPipe) -> Optional[Tuple[Any, threading.Thread]]:
    """``(prefetch_data, thread)`` of a ``Prefetcher`` (or ``PinMemory``) that is iterating:
    ``prefetch_data`` has the flags ``run_prefetcher``, ``paused`` (set by the thread once it
    stopped producing) and ``stop_iteration`` (set once its source ended). Else ``None``."""
    if not isinstance(dp, PrefetcherIterDataPipe):
        return None
    data, thread = getattr(dp, "prefetch_data", None), getattr(dp, "thread", None)
    return None if data is None or thread is None else (data, thread)
