"""Resumable, the base of the DataPipes that keep between two items what a generator keeps in
its frame: a loaded state is checked when loaded and used by the next iteration only, and a
DataPipe becomes resumable in place, keeping what it is."""

from __future__ import annotations

import pickle
from typing import Any, Dict, Iterator, List

import pytest
from torch.testing._internal.common_utils import TestCase
from torch.utils.data import IterDataPipe
from torchdata.datapipes.iter import IterableWrapper
from torchdata.datapipes.iter.util.header import HeaderIterDataPipe

from torchdata_snapshot.graph_state.resumable import Expanding, Resumable, as_resumable, expect_state


class CountingHeader(HeaderIterDataPipe, Resumable):
    """A Header that counts what it took: the shape of the package's resumable classes."""

    STATE = {"taken": int}
    TRANSIENT = ("_scratch",)
    __getstate__ = Resumable.__getstate__
    _taken = 0
    _scratch: List[int] = []

    def __iter__(self) -> Iterator[Any]:
        state = self._take_pending()
        self._taken = state["taken"] if state else 0
        self._scratch = [self._taken]
        for value in self.source_datapipe:
            if self._taken >= self.limit:
                return
            self._taken += 1
            yield value

    def state_dict(self) -> Dict[str, Any]:
        return {"taken": self._taken}


class Doubling(IterDataPipe, Expanding):
    """Each element of a list expands into itself twice."""

    def __init__(self, elements: List[int]) -> None:
        self.datapipe = IterableWrapper(elements)

    def _expand(self, element: Any) -> List[Any]:
        return [element, element]

    def __iter__(self) -> Iterator[Any]:
        yield from self._expanded()


class Declining:
    """An adapter for DataPipes that cannot resume."""

    def adapts(self, dp: Any) -> bool:
        return False

    def adapt(self, dp: Any) -> Any:
        raise AssertionError("not asked")


class TestResumable(TestCase):
    def test_a_datapipe_becomes_resumable_in_place(self) -> None:
        header = IterableWrapper(range(10)).header(4)
        configuration = dict(vars(header))
        assert CountingHeader.adapt(header) is header and type(header) is CountingHeader
        assert {k: v for k, v in vars(header).items() if k in configuration} == configuration
        assert list(header) == [0, 1, 2, 3] and len(header) == 4  # (its own __len__)

    def test_as_resumable_uses_the_adapter_that_adapts_it_else_the_datapipe_itself(self) -> None:
        header = IterableWrapper(range(3)).header(2)
        assert as_resumable(header, {}) is header and type(header) is HeaderIterDataPipe
        assert as_resumable(header, {HeaderIterDataPipe: Declining()}) is header
        assert type(header) is HeaderIterDataPipe
        assert as_resumable(header, {HeaderIterDataPipe: CountingHeader}) is header
        assert type(header) is CountingHeader

    def test_a_loaded_state_is_used_by_the_next_iteration_only(self) -> None:
        header = CountingHeader.adapt(IterableWrapper(range(10)).header(4))
        header.load_state_dict({"taken": 3})  # type: ignore[attr-defined]
        assert list(header) == [0]  # (the source starts afresh: only the count was loaded)
        assert list(header) == [0, 1, 2, 3]
        header.load_state_dict({"taken": 1})  # type: ignore[attr-defined]
        header.discard_loaded_state()  # type: ignore[attr-defined]
        assert list(header) == [0, 1, 2, 3]

    def test_a_state_without_its_fields_or_of_other_types_is_refused_when_loaded(self) -> None:
        header = CountingHeader.adapt(IterableWrapper(range(10)).header(4))
        for state, problem in [
            ({}, "must have the fields \\['taken'\\]"),
            ({"taken": 1, "more": 2}, "must have the fields"),
            ({"taken": "1"}, "'taken' is not a valid"),
            ({"taken": -1}, "'taken' is not a valid"),
            ({"taken": True}, "'taken' is not a valid"),
            ([1], "must have the fields"),
        ]:
            with pytest.raises(ValueError, match=f"the state of CountingHeader.*{problem}"):
                header.load_state_dict(state)  # type: ignore[attr-defined]
        assert list(header) == [0, 1, 2, 3], "nothing was loaded"
        assert expect_state({"a": 0, "b": None}, "x", a=int, b=(str, type(None))) == {"a": 0, "b": None}

    def test_what_an_iteration_holds_is_not_pickled(self) -> None:
        header = CountingHeader.adapt(IterableWrapper(range(10)).header(4))
        it = iter(header)
        next(it)
        again = pickle.loads(pickle.dumps(header))
        assert "_scratch" not in vars(again) and "_taken" in vars(again)

    def test_an_expander_counts_the_items_of_its_element_and_skips_those_it_is_told_to(self) -> None:
        doubling = Doubling([1, 2, 3])
        it = iter(doubling)
        assert [next(it), next(it), next(it)] == [1, 1, 2]
        assert doubling.element_items() == 1 and doubling.state_dict() == {"items": [2], "took": 1}
        again = Doubling([3])
        again.load_state_dict(doubling.state_dict())
        assert list(again) == [2, 3, 3]
        skipping = Doubling([1, 2])
        skipping.skip_per_element(lambda: 1)
        assert list(skipping) == [1, 2]
        skipping.skip_per_element(None)
        assert list(skipping) == [1, 1, 2, 2]
