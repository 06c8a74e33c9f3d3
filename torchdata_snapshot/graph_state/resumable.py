"""``Resumable``: what stateful restore adds to a DataPipe class whose state lives in its generator.

A subclass of such a class keeps in attributes what the class keeps in its generator's frame:
``state_dict()`` describes it at a yield point, and a state given to ``load_state_dict()`` is
checked at once (field by field, :func:`expect_state`) and used by the next iteration only. A
DataPipe of the class becomes one of the subclass in place (:meth:`Resumable.adapt`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, Mapping, Optional, Protocol, Tuple

from torch.utils.data import IterDataPipe

__all__ = ["Adapter", "Expander", "Expanding", "Resumable", "as_resumable", "expect_state"]


def expect_state(state: Any, owner: str, **fields: Any) -> Dict[str, Any]:
    """``state`` if it is a dict with exactly ``fields`` (name -> type, or tuple of types; ints
    must be non-negative), else ``ValueError`` naming what is wrong: a state is checked when it is
    loaded, not when a corrupted one would fail halfway through an iteration."""
    if not isinstance(state, dict) or set(state) != set(fields):
        raise ValueError(f"the state of {owner} must have the fields {sorted(fields)}, got {state!r:.200}")
    for name, kind in fields.items():
        value = state[name]
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            raise ValueError(f"the state of {owner}: {name!r} is not a valid {kind}: {value!r:.200}")
    return state


class Adapter(Protocol):
    """How a DataPipe of a given class resumes: a :class:`Resumable` subclass of that class (the
    DataPipe becomes one in place), or a DataPipe wrapping it."""

    def adapts(self, dp: Any) -> bool:
        """Whether the DataPipe ``dp`` can resume (an ``IterableWrapper`` over a generator cannot)."""

    def adapt(self, dp: Any) -> Any:
        """``dp``, resumable (itself, or the DataPipe that takes its place in the graph)."""


def as_resumable(dp: IterDataPipe, adapters: Mapping[type, Adapter]) -> IterDataPipe:
    """``dp`` made resumable by its adapter in ``adapters`` (in place, or wrapped), else itself
    (a class that keeps its own state, or one that holds none)."""
    adapter = adapters.get(type(dp))
    return adapter.adapt(dp) if adapter is not None and adapter.adapts(dp) else dp


class Resumable:
    """What a DataPipe class adds to resume: ``state_dict()`` describes the DataPipe at a yield
    point; a state given to ``load_state_dict()`` is checked against ``STATE`` (field -> type)
    and used by the next iteration, once.

    A mixin, whatever ``IterDataPipe`` the class extends: after the DataPipe class in a subclass
    of it (``class ResumableX(X, Resumable)``: X's layout comes first, so that a DataPipe of X can
    become one in place), before ``IterDataPipe`` in a class of its own (``class X(Resumable,
    IterDataPipe[T])``). In a subclass of a DataPipe class the configuration stays the
    original's, so the subclass initializes nothing (class attributes give its state's defaults).
    """

    STATE: Dict[str, Any] = {}
    #: Attributes that hold the iteration in progress (open streams among them): not pickled
    #: when the graph is (DataLoader2 and the graph's traversal pickle it); class defaults stand in.
    TRANSIENT: Tuple[str, ...] = ()
    _pending: Optional[Dict[str, Any]] = None

    @classmethod
    def adapts(cls, dp: IterDataPipe) -> bool:
        """Whether ``dp`` (of the class this one extends) can resume as one of these."""
        return True

    @classmethod
    def adapt(cls, dp: IterDataPipe) -> IterDataPipe:
        """``dp`` made one of these in place: its configuration and identity stay, its class
        becomes this subclass of its own."""
        dp.__class__ = cls  # type: ignore[assignment]
        return dp

    def __getstate__(self) -> Any:
        """The DataPipe class's own state, or, with ``TRANSIENT`` attributes, the attributes but
        those, as ``IterDataPipe`` gives them (a subclass of a DataPipe class, which comes first,
        names this one as its ``__getstate__``)."""
        if not self.TRANSIENT:
            return super().__getstate__()  # type: ignore[misc]
        state = {k: v for k, v in self.__dict__.items() if k not in self.TRANSIENT}
        if IterDataPipe.getstate_hook is not None:
            return IterDataPipe.getstate_hook(state)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._pending = self._check_state(expect_state(state, type(self).__name__, **self.STATE))

    def _check_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """Checks beyond the fields' types (a subclass's); the state, unchanged."""
        return state

    def _take_pending(self) -> Optional[Dict[str, Any]]:
        state, self._pending = self._pending, None
        return state

    def discard_loaded_state(self) -> None:
        """The next iteration starts afresh, not from a state loaded and not used yet."""
        self._pending = None

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError


def _no_skip() -> int:
    return 0


class Expander(Resumable):
    """A resumable DataPipe that yields several items per element of its source (a reader,
    ``flatmap``, ``unbatch``). It counts the items it took from its current element, from the
    element's first on (:meth:`element_items`), and, when it starts an element, skips as many as
    ``skip_items()`` says: in an epoch resumed elastically, the items of that element that were
    delivered before (elastic resume: see
    :class:`~torchdata_snapshot.graph_state.worker_loop.ElasticWorker`)."""

    TRANSIENT: Tuple[str, ...] = ("skip_items",)
    skip_items: Callable[[], int] = staticmethod(_no_skip)

    def element_items(self) -> int:
        raise NotImplementedError

    def skip_per_element(self, skip_items: Optional[Callable[[], int]]) -> None:
        """Skip ``skip_items()`` items of each element from now on (``None``: none)."""
        self.skip_items = skip_items or _no_skip


class Expanding(Expander):
    """A one-to-many DataPipe: each source element expands into items; its state is what is left
    of the current element's expansion (which therefore is materialized when it starts) and how
    many of its items were taken. The class it extends gives ``_expand`` and an ``__iter__`` that
    yields from :meth:`_expanded`."""

    STATE = {"items": list, "took": int}

    datapipe: Any  # (the source, an attribute of the class it extends)
    _items: Deque[Any] = deque()
    _took = 0

    def _expand(self, element: Any) -> Iterable[Any]:
        raise NotImplementedError

    def _expanded(self) -> Iterator[Any]:
        state = self._take_pending()
        self._items, self._took = (deque(state["items"]), state["took"]) if state else (deque(), 0)
        while self._items:
            self._took += 1
            yield self._items.popleft()
        for element in self.datapipe:
            skip = self.skip_items()
            self._items, self._took = deque(self._expand(element)), 0
            while self._items:
                item = self._items.popleft()
                self._took += 1
                if self._took > skip:
                    yield item

    def element_items(self) -> int:
        return self._took

    def state_dict(self) -> Dict[str, Any]:
        return {"items": list(self._items), "took": self._took}
