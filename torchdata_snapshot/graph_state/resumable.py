"""``Resumable``: the base of the DataPipes that stateful restore adds to a worker's graph.

Such a DataPipe keeps in attributes what a torchdata DataPipe keeps in its generator's frame:
``state_dict()`` describes it at a yield point, and a state given to ``load_state_dict()`` is
checked at once (field by field, :func:`expect_state`) and used by the next iteration only.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from torch.utils.data import IterDataPipe

__all__ = ["Expander", "Resumable", "expect_state"]


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


class Resumable(IterDataPipe):
    """Base of the resumable equivalents: ``state_dict()`` describes the DataPipe at a yield
    point; a state given to ``load_state_dict()`` is checked against ``STATE`` (field -> type)
    and used by the next iteration, once."""

    STATE: Dict[str, Any] = {}
    #: Attributes that hold the iteration in progress (open streams among them): not pickled
    #: when the graph is (DataLoader2 and the graph's traversal pickle it); class defaults stand in.
    TRANSIENT: Tuple[str, ...] = ()
    _pending: Optional[Dict[str, Any]] = None

    def __getstate__(self) -> Dict[str, Any]:
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
