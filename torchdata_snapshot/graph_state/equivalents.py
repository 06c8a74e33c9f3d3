"""Resumable subclasses of torch's and torchdata's DataPipes whose state lives in generator frames.

In a worker whose graph can resume from captured states, ``GraphState.make_resumable`` makes
each DataPipe of a type in ``ADAPTERS`` an instance of its subclass here, in place: the
DataPipe keeps its configuration and its own methods, and the subclass adds what its generator
kept in the frame as attributes (see :class:`~torchdata_snapshot.graph_state.resumable.Resumable`),
yielding exactly what the original yields, epoch after epoch. ``Shuffler`` keeps its state in
attributes already: only its ``reset()`` changes. The types that hold no state at a yield point
stay as they are (``stateless`` in :mod:`torchdata_snapshot.core.catalogue`).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import os
import random
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, Optional, Type

from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.combinatorics import ShufflerIterDataPipe
from torch.utils.data.datapipes.iter.combining import (
    ConcaterIterDataPipe,
    MultiplexerIterDataPipe,
)
from torch.utils.data.datapipes.iter.filelister import FileListerIterDataPipe
from torch.utils.data.datapipes.iter.grouping import UnBatcherIterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe
from torch.utils.data.datapipes.utils.common import get_file_pathnames_from_root
from torchdata.datapipes.iter import Cycler as CyclerIterDataPipe
from torchdata.datapipes.iter import FlatMapper as FlatMapperIterDataPipe
from torchdata.datapipes.iter import Header as HeaderIterDataPipe

from torchdata_snapshot._compat.datapipes import samples_yielded
from torchdata_snapshot._errors import ChangedFileError
from torchdata_snapshot.checkpoint.rng_states import pack_python_state, unpack_python_state
from torchdata_snapshot.graph_state.resumable import Expanding, Resumable

__all__ = [
    "ADAPTERS",
    "ResumableConcater",
    "ResumableCycler",
    "ResumableFileLister",
    "ResumableFlatMapper",
    "ResumableHeader",
    "ResumableIterableWrapper",
    "ResumableMultiplexer",
    "ResumableShuffler",
    "ResumableUnBatcher",
]


class ResumableIterableWrapper(IterableWrapperIterDataPipe, Resumable):
    """``IterableWrapper`` over a sequence: its state is the position in it (where this iteration
    started plus what torch's iterator hook counted since, so no per-item bookkeeping). A
    resumed iteration starts at the position by indexing, in constant time."""

    STATE = {"position": int}
    _start = 0

    @classmethod
    def adapts(cls, dp: IterDataPipe) -> bool:
        iterable = getattr(dp, "iterable", None)
        return isinstance(iterable, (Sequence, range)) and not isinstance(iterable, (str, bytes))

    iterable: Sequence[Any]  # (a sequence: see adapts())

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        if state["position"] > len(self.iterable):
            raise ValueError(f"position {state['position']} is past the end ({len(self.iterable)} items)")
        return state

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        source = self.iterable
        if self.deepcopy:
            try:
                source = copy.deepcopy(self.iterable)
            except TypeError:
                warnings.warn(
                    "The input iterable can not be deepcopied, "
                    "please be aware of in-place modification would affect source data.",
                    stacklevel=2,
                )
        self._start = state["position"] if state else 0
        # Indexing starts at the position in O(1); islice would walk the skipped items.
        yield from map(source.__getitem__, range(self._start, len(source)))

    def state_dict(self) -> Dict[str, Any]:
        return {"position": self._start + samples_yielded(self)}


class ResumableShuffler(ShufflerIterDataPipe, Resumable):
    """``Shuffler`` keeps its buffer and RNG in attributes already: its state is theirs, and only
    its ``reset()`` (at the start of each iteration) changes: a loaded state stands in for the
    fresh buffer and seed."""

    STATE = {"enabled": bool, "buffer": list, "rng": tuple}

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        random.Random().setstate(unpack_python_state(state["rng"]))  # raises for a state that is not one
        return state

    def reset(self) -> None:
        state = self._take_pending()
        if state is None:
            super().reset()
            return
        # What the shuffler had after the items of the state: a reseed would draw another order.
        self._enabled, self._buffer, self._seed = state["enabled"], list(state["buffer"]), None
        self._rng.setstate(unpack_python_state(state["rng"]))

    def state_dict(self) -> Dict[str, Any]:
        return {
            "enabled": self._enabled,
            "buffer": list(self._buffer),
            "rng": pack_python_state(self._rng.getstate()),
        }


class ResumableUnBatcher(UnBatcherIterDataPipe, Expanding):
    """``UnBatcher``, through its own expansion of an element."""

    __getstate__ = Expanding.__getstate__  # (before IterDataPipe's: the iteration's own is not pickled)

    def _expand(self, element: Any) -> Iterable[Any]:
        return self._dive(element, unbatch_level=self.unbatch_level)

    def __iter__(self) -> Iterator[Any]:
        yield from self._expanded()


class ResumableFlatMapper(FlatMapperIterDataPipe, Expanding):
    """``FlatMapper``, through its own ``_apply_fn`` (``input_col`` handling included)."""

    __getstate__ = Expanding.__getstate__  # (before IterDataPipe's: the iteration's own is not pickled)

    def _expand(self, element: Any) -> Iterable[Any]:
        return self._apply_fn(element)

    def __iter__(self) -> Iterator[Any]:
        yield from self._expanded()


class ResumableHeader(HeaderIterDataPipe, Resumable):
    """``Header``: its state is how many items it took."""

    STATE = {"taken": int}
    _taken = 0

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._taken = state["taken"] if state else 0
        for value in self.source_datapipe:
            self._taken += 1
            if self.limit is None or self._taken <= self.limit:
                yield value
            else:
                break

    def state_dict(self) -> Dict[str, Any]:
        return {"taken": self._taken}


class ResumableCycler(CyclerIterDataPipe, Resumable):
    """``Cycler``: its state is the cycle in progress (the source holds its own position).

    A loaded state belongs to the pass in progress when it was captured: every later pass
    iterates the source afresh, so ``on_new_pass`` forgets the states loaded into the source's
    subgraph before it starts (:meth:`GraphState.make_resumable` sets it).
    """

    STATE = {"cycle": int}
    _cycle = 0
    # A function, neither a DataPipe nor a collection: graph traversal (which pickles
    # DataPipes) does not take the DataPipes it refers to for sources.
    on_new_pass: Optional[Callable[[], None]] = None

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._cycle = state["cycle"] if state else 0
        first_pass = True
        while self.count is None or self._cycle < self.count:
            if not first_pass and self.on_new_pass is not None:
                self.on_new_pass()
            first_pass = False
            yield from self.source_datapipe
            self._cycle += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"cycle": self._cycle}


class ResumableConcater(ConcaterIterDataPipe, Resumable):
    """``Concater``: its state is the source in progress."""

    STATE = {"index": int}
    _index = 0

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        if state["index"] > len(self.datapipes):
            raise ValueError(f"source {state['index']} of {len(self.datapipes)} does not exist")
        return state

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._index = state["index"] if state else 0
        while self._index < len(self.datapipes):
            yield from self.datapipes[self._index]
            self._index += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"index": self._index}


class ResumableMultiplexer(MultiplexerIterDataPipe, Resumable):
    """``Multiplexer`` (one item from each source per round, until one is exhausted): its state is
    what is left of the round in progress."""

    STATE = {"round": list}
    _round: Deque[Any] = deque()

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._round = deque(state["round"]) if state else deque()
        iterators = [iter(x) for x in self.datapipes]
        while self._round:
            yield self._round.popleft()
        while iterators:
            taken = []
            for it in iterators:
                try:
                    taken.append(next(it))
                except StopIteration:
                    return
            self._round = deque(taken)
            while self._round:
                yield self._round.popleft()

    def state_dict(self) -> Dict[str, Any]:
        return {"round": list(self._round)}


def _listing_digest() -> Any:
    """A new digest of a listing's paths (one kind and size wherever it is computed or checked)."""
    return hashlib.blake2b(digest_size=16)


def _name_bytes(path: str, prefix: str) -> bytes:
    """A listed path as bytes for the listing's digest: its name below the root (``prefix``, as
    the lister's paths begin), so that a root that moved, listing the same names, has the same
    digest; any name a file system returns."""
    name = path[len(prefix) :].lstrip(os.sep) if path.startswith(prefix) else path
    return name.encode("utf-8", "surrogateescape") + b"\0"


class ResumableFileLister(FileListerIterDataPipe, Resumable):
    """``FileLister``: its state is the root being listed, how many of its files were yielded and
    a digest of their names below the root (the listing is recomputed on restore, not stored). A
    root that lists other files before that position now (a file added, removed or renamed,
    another order) is refused when the state is loaded: counting into another listing would skip
    or repeat files. The digest does not depend on where the root is: a state loaded with its
    root moved elsewhere checks the same names there."""

    STATE = {"root": (str, type(None)), "yielded": int, "listed": (str, type(None))}
    #: The running digest (a hash object does not pickle; the graph is pickled between epochs).
    TRANSIENT = ("_listed",)
    __getstate__ = Resumable.__getstate__  # (before IterDataPipe's: the iteration's own is not pickled)
    _listed = _listing_digest()  # never updated: each root starts its own
    _root: Optional[str] = None
    _yielded = 0

    def _list(self, root: str) -> Iterable[str]:
        return get_file_pathnames_from_root(
            root, self.masks, self.recursive, self.abspath, self.non_deterministic
        )

    def _prefix(self, root: str) -> str:
        """How the paths listed under ``root`` begin."""
        return os.path.abspath(root) if self.abspath else root

    def _start_root(self, root: str, skip: int = 0) -> Iterator[str]:
        """The root's listing from its ``skip``-th path on, the digest brought past the others."""
        self._root, self._yielded, self._listed = root, 0, _listing_digest()
        prefix = self._prefix(root)
        for path in self._list(root):
            self._yielded += 1
            self._listed.update(_name_bytes(path, prefix))
            if self._yielded > skip:
                yield path

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if isinstance(state, dict) and set(state) == {"root", "yielded"}:
            state = {**state, "listed": None}  # a state of an earlier release: no digest to check
        super().load_state_dict(state)

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        root, yielded = state["root"], state["yielded"]
        if root is not None and state["listed"] is not None:
            listed = _listing_digest()
            paths = list(itertools.islice(self._list(root), yielded))
            prefix = self._prefix(root)
            listed.update(b"".join(_name_bytes(path, prefix) for path in paths))
            if len(paths) < yielded or listed.hexdigest() != state["listed"]:
                raise ChangedFileError(
                    f"{root} lists other files than when the state was taken: the {yielded} it had "
                    f"handed on are not its first {yielded} now (a file added, removed or renamed): "
                    "resuming would skip or repeat files; put its files back as they were, or resume "
                    "from a checkpoint taken since they changed"
                )
        return state

    def __iter__(self) -> Iterator[str]:
        state = self._take_pending()
        self._root, self._yielded, self._listed = None, 0, _listing_digest()
        if state and state["root"] is not None:
            yield from self._start_root(state["root"], skip=state["yielded"])
        for root in self.datapipe:
            yield from self._start_root(root)

    def state_dict(self) -> Dict[str, Any]:
        return {"root": self._root, "yielded": self._yielded, "listed": self._listed.hexdigest()}


#: DataPipe type -> its resumable subclass, which the DataPipe becomes in place
#: (:meth:`Resumable.adapt`) when the subclass ``adapts`` it.
ADAPTERS: Dict[type, Type[Resumable]] = {
    IterableWrapperIterDataPipe: ResumableIterableWrapper,
    ShufflerIterDataPipe: ResumableShuffler,
    UnBatcherIterDataPipe: ResumableUnBatcher,
    FlatMapperIterDataPipe: ResumableFlatMapper,
    HeaderIterDataPipe: ResumableHeader,
    CyclerIterDataPipe: ResumableCycler,
    ConcaterIterDataPipe: ResumableConcater,
    MultiplexerIterDataPipe: ResumableMultiplexer,
    FileListerIterDataPipe: ResumableFileLister,
}
