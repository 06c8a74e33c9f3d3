"""Resumable readers: the DataPipes that open, decompress, unpack and parse files.

In a worker whose graph resumes from captured states (see :mod:`torchdata_snapshot.graph_state.graph_state`)
torch's and torchdata's reader DataPipes become resumable, as the others do
(:mod:`torchdata_snapshot.graph_state.equivalents`). The openers and readers are wrapped: the
wrapper runs their own code, one element at a time (:class:`_PerElement`), so they yield
exactly what the originals yield:

* the DataPipes that make a stream of each element (``FileOpener``, ``FSSpecFileOpener``,
  ``decompress``, ``load_from_xz``, ``load_from_bz2``) hold nothing at a yield point; they give
  each stream its origin (:mod:`torchdata_snapshot.graph_state.file_origins`), so that a state
  can refer to it;
* the DataPipes that read several items out of each element (``readlines``, ``parse_csv``,
  ``parse_csv_as_dict``, ``read_from_stream``, ``load_from_tar``, ``load_from_zip``) keep the
  element they are reading and how many items they took from it: a restore opens the element's
  streams again and skips those items, reading at most one element's prefix again (never
  running what comes after the reader on it); the members of an archive get origins too.

What comes after them and accumulates or counts (``webdataset``, ``lines_to_paragraphs``,
``enumerate``, ``add_index``) is in :mod:`torchdata_snapshot.graph_state.accumulators`.

A restore refuses a file that changed since the state was taken
(:class:`~torchdata_snapshot.ChangedFileError`). A user's DataPipe that keeps a stream across
items is restored by its own state: a stream is opened again at its start, so such a DataPipe
must record how far it read.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Optional, cast

from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.fileopener import FileOpenerIterDataPipe
from torch.utils.data.datapipes.iter.streamreader import StreamReaderIterDataPipe
from torchdata.datapipes.iter import (
    Bz2FileLoader,
    CSVDictParser,
    CSVParser,
    Decompressor,
    FSSpecFileOpener,
    LineReader,
    TarArchiveLoader,
    XzFileLoader,
    ZipArchiveLoader,
)

from torchdata_snapshot._compat.datapipes import compression_type
from torchdata_snapshot.graph_state.file_origins import (
    ArchiveMemberOrigin,
    DecompressedOrigin,
    FileOrigin,
    check_described,
    describe,
    file_origin,
    origin_of,
    rebuild,
    with_origin,
)
from torchdata_snapshot.graph_state.resumable import Adapter, Expander

__all__ = [
    "READER_ADAPTERS",
    "StreamMaker",
]

#: Attributes torch's iterator hook keeps on every DataPipe: not part of a reader's configuration.
_HOOK_FIELDS = frozenset(
    {"_valid_iterator_id", "_number_of_samples_yielded", "_snapshot_state", "_fast_forward_iterator"}
)

#: Gives the streams of an item their origins: ``attach(element, item) -> item``.
Attach = Callable[[Any, Any], Any]


class _PerElement:
    """The DataPipe ``original``, run on one element at a time: a fresh instance of its
    class with its configuration and a one-element source. Holds no DataPipe (the graph of the
    resumable DataPipe that owns it must not see the original)."""

    def __init__(self, original: IterDataPipe, source: str) -> None:
        self.kind = type(original)
        self.source = source
        self.fields = {k: v for k, v in vars(original).items() if k != source and k not in _HOOK_FIELDS}

    def instance(self, element: Any) -> IterDataPipe:
        one = self.kind.__new__(self.kind)
        one.__dict__.update(self.fields)
        setattr(one, self.source, (element,))
        return one

    def __call__(self, element: Any) -> Iterator[Any]:
        return iter(self.instance(element))


def _take_source(owner: IterDataPipe, original: IterDataPipe) -> _PerElement:
    """Give ``owner`` ``original``'s source DataPipe, under the same attribute name (recorded as
    ``owner._source``), and return the original's code to run on each element."""
    names = [k for k, v in vars(original).items() if isinstance(v, IterDataPipe)]
    if len(names) != 1:
        raise TypeError(f"{type(original).__name__} has not one source DataPipe: {names}")
    setattr(owner, names[0], getattr(original, names[0]))
    owner._source = names[0]  # type: ignore[attr-defined]
    return _PerElement(original, names[0])


class StreamMaker(IterDataPipe):
    """A DataPipe that makes one ``(path, stream)`` of each element, run as the original does, each
    stream given its origin. It holds nothing at a yield point.

    The files it opens (their :class:`~torchdata_snapshot.graph_state.file_origins.FileOrigin`,
    with the size and modification time they had) are noted until :meth:`take_opened` takes
    them: the worker sends them with the item whose production opened them, so that a restore
    can check every file it reads again, not only those a captured state names."""

    _source: str
    opened: List[FileOrigin]

    def __init__(self, original: IterDataPipe, attach: Callable[[_PerElement], Attach]) -> None:
        self._each = _take_source(self, original)
        self._attach = attach(self._each)
        self.opened = []

    def __iter__(self) -> Iterator[Any]:
        for element in getattr(self, self._source):
            for item in self._each(element):
                item = self._attach(element, item)
                origin = origin_of(item[1])
                if isinstance(origin, FileOrigin):
                    self.opened.append(origin)
                yield item

    def take_opened(self) -> List[FileOrigin]:
        """The files opened since the last call, in order."""
        opened, self.opened = self.opened, []
        return opened

    def __len__(self) -> int:
        return len(getattr(self, self._source))


class ResumableReader(Expander, IterDataPipe):
    """A DataPipe that reads several items out of each element, run as the original does; its state is
    the element it is reading (streams as origins) and how many items it took from it."""

    STATE = {"reading": bool, "element": object, "taken": int}
    TRANSIENT = (*Expander.TRANSIENT, "_element")
    _element: Any = None
    _source: str

    def __init__(
        self, original: IterDataPipe, attach: Optional[Callable[[_PerElement], Attach]] = None
    ) -> None:
        self._each = _take_source(self, original)
        self._attach = None if attach is None else attach(self._each)
        self._reading = False
        self._taken = 0

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        check_described(state["element"])  # a changed file is refused now, not halfway through
        return state

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._reading, self._taken = False, 0
        if state is not None and state["reading"]:
            yield from self._read(rebuild(state["element"]), skip=state["taken"])
        for element in getattr(self, self._source):
            yield from self._read(element, skip=self.skip_items())
        self._reading = False

    def _read(self, element: Any, skip: int) -> Iterator[Any]:
        self._element, self._reading, self._taken = element, True, 0
        for item in self._each(element):
            self._taken += 1
            if self._taken > skip:
                yield item if self._attach is None else self._attach(element, item)

    def element_items(self) -> int:
        return self._taken

    def state_dict(self) -> Dict[str, Any]:
        element = describe(self._element) if self._reading else None
        return {"reading": self._reading, "element": element, "taken": self._taken}


# --- origins ----------------------------------------------------------------------------------------


def _attach_file(each: _PerElement) -> Attach:
    mode = each.fields["mode"]
    mode = "r" + mode if mode in ("b", "t") else mode
    encoding = each.fields["encoding"]

    def attach(path: str, item: Any) -> Any:
        return item[0], with_origin(item[1], file_origin(path, mode, encoding, item[1].file_obj))

    return attach


def _attach_fsspec_file(each: _PerElement) -> Attach:
    connection = tuple(sorted(each.fields["kwargs_for_connection"].items()))
    opening = tuple(sorted(each.fields["kwargs_for_open"].items()))
    mode = each.fields["mode"]

    def attach(uri: str, item: Any) -> Any:
        return item[0], with_origin(
            item[1], file_origin(uri, mode, None, item[1].file_obj, (connection, opening))
        )

    return attach


def _attach_decompressed(file_type: Optional[str]) -> Callable[[_PerElement], Attach]:
    """``file_type``: the loader's compression, or ``None`` for ``decompress``'s detection."""

    def attach_for(each: _PerElement) -> Attach:
        def attach(element: Any, item: Any) -> Any:
            inner = origin_of(element[1])
            if inner is None:
                return item
            kind = file_type or compression_type(cast(Decompressor, each.instance(element)), element[0])
            return item[0], with_origin(item[1], DecompressedOrigin(inner, kind))

        return attach

    return attach_for


def _attach_member(tar: bool) -> Callable[[_PerElement], Attach]:
    def attach_for(each: _PerElement) -> Attach:
        tar_mode = each.fields.get("mode") if tar else None

        def attach(element: Any, item: Any) -> Any:
            archive = origin_of(element[1])
            if archive is None:
                return item
            name = os.path.normpath(os.path.relpath(item[0], element[0]))
            return item[0], with_origin(item[1], ArchiveMemberOrigin(archive, name, tar_mode))

        return attach

    return attach_for


class _Wrapping:
    """The adapter of a DataPipe that a new one wraps, running the DataPipe's own code on each
    element (a stream maker, a reader)."""

    def __init__(self, wrap: Callable[[IterDataPipe], IterDataPipe]) -> None:
        self.wrap = wrap

    def adapts(self, dp: IterDataPipe) -> bool:
        return True

    def adapt(self, dp: IterDataPipe) -> IterDataPipe:
        return self.wrap(dp)


_READER = _Wrapping(ResumableReader)

#: DataPipe type -> its adapter (see :class:`~torchdata_snapshot.graph_state.resumable.Adapter`).
READER_ADAPTERS: Dict[type, Adapter] = {
    FileOpenerIterDataPipe: _Wrapping(lambda dp: StreamMaker(dp, _attach_file)),
    FSSpecFileOpener: _Wrapping(lambda dp: StreamMaker(dp, _attach_fsspec_file)),
    Decompressor: _Wrapping(lambda dp: StreamMaker(dp, _attach_decompressed(None))),
    XzFileLoader: _Wrapping(lambda dp: StreamMaker(dp, _attach_decompressed("lzma"))),
    Bz2FileLoader: _Wrapping(lambda dp: StreamMaker(dp, _attach_decompressed("bz2"))),
    LineReader: _READER,
    CSVParser: _READER,
    CSVDictParser: _READER,
    StreamReaderIterDataPipe: _READER,
    TarArchiveLoader: _Wrapping(lambda dp: ResumableReader(dp, _attach_member(tar=True))),
    ZipArchiveLoader: _Wrapping(lambda dp: ResumableReader(dp, _attach_member(tar=False))),
}
