"""Resumable subclasses of torchdata's DataPipes that accumulate or count what passes through them.

After the readers (:mod:`torchdata_snapshot.graph_state.readers`), these hold what they took from
their source at a yield point: ``webdataset`` the sample it began, ``lines_to_paragraphs`` the
lines of the paragraph in progress, ``enumerate`` and ``add_index`` the next index. In a worker
whose graph resumes from captured states such a DataPipe becomes its subclass here in place
(:meth:`~torchdata_snapshot.graph_state.resumable.Resumable.adapt`), which keeps that in
attributes; the elastic resume asks the first two how many items of their source they hold
(``held_items``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Tuple, Type

from torchdata.datapipes.iter import Enumerator, IndexAdder, ParagraphAggregator, WebDataset
from torchdata.datapipes.iter.util.webdataset import pathsplit as webdataset_pathsplit

from torchdata_snapshot.graph_state.file_origins import check_described, describe, rebuild
from torchdata_snapshot.graph_state.resumable import Resumable

__all__ = [
    "ACCUMULATOR_ADAPTERS",
    "ResumableEnumerator",
    "ResumableIndexAdder",
    "ResumableParagraphAggregator",
    "ResumableWebDataset",
]


class ResumableWebDataset(WebDataset, Resumable):
    """``webdataset``: groups consecutive ``(path, data)`` with the same key into a sample. At a
    yield point it holds the next sample begun with the element that ended the last one."""

    STATE = {"sample": dict, "key": str}
    TRANSIENT = ("_sample",)
    __getstate__ = Resumable.__getstate__  # (before IterDataPipe's: the iteration's own is not pickled)
    _sample: Dict[str, Any] = {}
    _key = ""

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        state = self._take_pending()
        self._sample, self._key = (rebuild(state["sample"]), state["key"]) if state else ({}, "")
        for path, data in self.source_datapipe:
            assert isinstance(path, str), path
            key, suffix = webdataset_pathsplit(path)
            if suffix == "":
                continue
            if key != self._key:
                done, self._sample, self._key = self._sample, {"__key__": key}, key
                self._sample[suffix] = data
                if done:
                    yield done
                continue
            self._sample[suffix] = data
        done, self._sample = self._sample, {}
        if done:
            yield done

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        check_described(state["sample"])
        return state

    def held_items(self) -> int:
        """Items of its source it holds at a yield point: the one that began the next sample."""
        return 1 if self._sample else 0

    def state_dict(self) -> Dict[str, Any]:
        return {"sample": describe(self._sample), "key": self._key}


class ResumableParagraphAggregator(ParagraphAggregator, Resumable):
    """``lines_to_paragraphs``: its lines in progress are in its ``buffer`` already; its state is
    them and their file."""

    STATE = {"lines": list, "filename": (str, type(None))}
    _filename: Optional[str] = None

    def __iter__(self) -> Iterator[Tuple[str, str]]:
        state = self._take_pending()
        self.buffer, self._filename = (list(state["lines"]), state["filename"]) if state else ([], None)
        for filename, line in self.source_datapipe:
            if self._filename is None:
                self._filename = filename
            if line and self._filename == filename:
                self.buffer.append(line)
                continue
            done, previous = self.buffer, self._filename
            self.buffer, self._filename = ([line] if line else []), filename
            if done and previous is not None:  # (lines were taken: they have their file)
                yield previous, self.joiner(done)
        done, self.buffer = self.buffer, []
        if done and self._filename is not None:
            yield self._filename, self.joiner(done)

    def held_items(self) -> int:
        """Items of its source it holds at a yield point: the line that began the next paragraph."""
        return len(self.buffer)

    def state_dict(self) -> Dict[str, Any]:
        return {"lines": list(self.buffer), "filename": self._filename}


class ResumableEnumerator(Enumerator, Resumable):
    """``enumerate``: its state is the next index."""

    STATE = {"next": int}
    _next: Optional[int] = None  # (before its first iteration: its starting index)

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._next = state["next"] if state else self.starting_index
        for element in self.source_datapipe:
            index = self._next
            self._next = index + 1
            yield index, element

    def state_dict(self) -> Dict[str, Any]:
        return {"next": self.starting_index if self._next is None else self._next}


class ResumableIndexAdder(IndexAdder, Resumable):
    """``add_index``: its state is the next index."""

    STATE = {"next": int}
    _next = 0

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._next = state["next"] if state else 0
        for element in self.source_datapipe:
            if not isinstance(element, dict):
                raise NotImplementedError("We only support adding index to row or batch in dict type")
            element[self.index_name], self._next = self._next, self._next + 1
            yield element

    def state_dict(self) -> Dict[str, Any]:
        return {"next": self._next}


#: DataPipe type -> its resumable subclass (see :class:`~torchdata_snapshot.graph_state.resumable.Adapter`).
ACCUMULATOR_ADAPTERS: Dict[type, Type[Resumable]] = {
    WebDataset: ResumableWebDataset,
    ParagraphAggregator: ResumableParagraphAggregator,
    Enumerator: ResumableEnumerator,
    IndexAdder: ResumableIndexAdder,
}
