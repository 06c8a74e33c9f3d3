"""Resumable equivalents, on their own: each yields what its original DataPipe yields, and a new
chain loaded with the states a chain reported after k items yields the rest, exactly."""

from __future__ import annotations

import functools
import os
import pickle
import unittest
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import pytest
import torch
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data import IterDataPipe
from torchdata.datapipes.iter import FileLister, IterableWrapper

from torchdata_snapshot._errors import ChangedFileError
from torchdata_snapshot.graph_state.equivalents import ADAPTERS, ResumableIterableWrapper, ResumableShuffler
from torchdata_snapshot.graph_state.resumable import Expander, Resumable, as_resumable

Build = Callable[[Callable[[Sequence[Any]], IterDataPipe], Path], IterDataPipe]


def _repeat_by_rest(x: int) -> List[int]:
    return [x] * (x % 3)


def _shuffled(source: Callable[[Sequence[Any]], IterDataPipe], _: Path) -> IterDataPipe:
    return source(range(30)).shuffle(buffer_size=8).set_seed(7)


#: Type name -> the original DataPipe over ``source(items)`` leaves (a resumable wrapper
#: or torchdata's ``IterableWrapper``); ``tmp`` holds files for ``FileLister``.
BUILDS: Dict[str, Build] = {
    "ShufflerIterDataPipe": _shuffled,
    "UnBatcherIterDataPipe": lambda source, _: source(range(12)).batch(5).unbatch(),
    "FlatMapperIterDataPipe": lambda source, _: source(range(10)).flatmap(_repeat_by_rest),
    "HeaderIterDataPipe": lambda source, _: source(range(30)).header(17),
    "CyclerIterDataPipe": lambda source, _: source(range(7)).cycle(3),
    "ConcaterIterDataPipe": lambda source, _: source(range(6)).concat(source(range(9))),
    "MultiplexerIterDataPipe": lambda source, _: source(range(4)).mux(source(range(9))),
    "FileListerIterDataPipe": lambda source, tmp: FileLister(source([str(tmp), str(tmp / "sub")])),
}


def _chain(build: Build, tmp: Path, resumable: bool) -> List[IterDataPipe]:
    """``[leaves..., top]``: with ``resumable``, leaves and top are the resumable equivalents."""
    leaves: List[IterDataPipe] = []

    def source(items: Sequence[Any]) -> IterDataPipe:
        leaf = ResumableIterableWrapper(items) if resumable else IterableWrapper(items)
        leaves.append(leaf)
        return leaf

    top = build(source, tmp)
    return [*leaves, as_resumable(top, ADAPTERS) if resumable else top]


def _length(dp: IterDataPipe) -> Any:
    """``len(dp)``, or the type of what it raised."""
    try:
        return len(dp)
    except TypeError as e:
        return type(e)


class TestResumableDatapipes(SuiteTestCase):
    @functools.cached_property
    def tmp(self) -> Path:
        """Files in a directory and its subdirectory ``sub``."""
        (self.tmp_path / "sub").mkdir()
        for name in ("b.txt", "a.txt", "c.txt", "d.bin", "sub/e.txt", "sub/f.txt"):
            (self.tmp_path / name).write_text(name)
        return self.tmp_path

    def test_every_adapted_type_is_exercised(self) -> None:
        assert {t.__name__ for t in ADAPTERS} <= set(BUILDS) | {"IterableWrapperIterDataPipe"}
        for name, build in BUILDS.items():
            assert isinstance(as_resumable(build(IterableWrapper, self.tmp), ADAPTERS), Resumable), name

    @parametrize("name", sorted(BUILDS))
    def test_the_equivalent_yields_what_the_original_yields(self, name: str) -> None:
        original = _chain(BUILDS[name], self.tmp, resumable=False)[-1]
        assert list(_chain(BUILDS[name], self.tmp, resumable=True)[-1]) == list(original)

    @parametrize("name", sorted(BUILDS))
    @parametrize("k", [1, 3, 5])
    def test_loaded_states_resume_after_k_items(self, name: str, k: int) -> None:
        chain = _chain(BUILDS[name], self.tmp, resumable=True)
        everything = list(_chain(BUILDS[name], self.tmp, resumable=True)[-1])
        it = iter(chain[-1])
        head = [next(it) for _ in range(k)]
        states = [dp.state_dict() for dp in chain]  # type: ignore[attr-defined]
        fresh = _chain(BUILDS[name], self.tmp, resumable=True)
        for dp, state in zip(fresh, states):
            dp.load_state_dict(state)  # type: ignore[attr-defined]
        assert head + list(fresh[-1]) == everything

    @parametrize("name", sorted(BUILDS))
    def test_a_restored_equivalent_reports_the_states_of_the_uninterrupted_one(self, name: str) -> None:
        """Item by item, and once its data is exhausted (restored at its end included): the state of
        a restored equivalent is the one the uninterrupted one had there, so that a restore from a
        state captured after a restore continues exactly too. (Its sources, when they have not
        started since their states were loaded, are the graph state's business: see test_stateful.)"""
        uninterrupted = _chain(BUILDS[name], self.tmp, resumable=True)
        everything, states = [], []
        for item in uninterrupted[-1]:
            everything.append(item)
            states.append([dp.state_dict() for dp in uninterrupted])  # type: ignore[attr-defined]
        exhausted = uninterrupted[-1].state_dict()  # type: ignore[attr-defined]
        for k in range(1, len(everything) + 1):
            restored = _chain(BUILDS[name], self.tmp, resumable=True)
            for dp, state in zip(restored, states[k - 1]):
                dp.load_state_dict(state)  # type: ignore[attr-defined]
            top = restored[-1]
            for j, item in enumerate(top, start=k):
                assert (item, top.state_dict()) == (everything[j], states[j][-1]), (
                    f"restored after {k}, item {j}"
                )
            assert top.state_dict() == exhausted, f"restored after {k}, exhausted"

    def test_a_file_lister_state_of_an_earlier_release_loads_without_its_listing_digest(self) -> None:
        roots, lister = _chain(BUILDS["FileListerIterDataPipe"], self.tmp, resumable=True)
        everything = list(lister)
        roots.load_state_dict({"position": 1})  # type: ignore[attr-defined]
        lister.load_state_dict({"root": str(self.tmp), "yielded": 2})  # type: ignore[attr-defined]
        assert list(lister) == everything[2:]
        with pytest.raises(ValueError, match="'listed' is not a valid"):
            lister.load_state_dict({"root": str(self.tmp), "yielded": 2, "listed": 7})  # type: ignore[attr-defined]

    @parametrize("abspath", [False, True])
    def test_a_file_lister_state_loads_into_a_root_moved_elsewhere_that_lists_the_same_names(
        self, abspath: bool
    ) -> None:
        """The listing's digest is of the names below the root: a state whose root was moved checks
        and continues the same names there (and a name that differs there is still refused)."""
        old, new = self.tmp_path / "old", self.tmp_path / "new"
        for root in (old, new):
            root.mkdir()
            for name in ("a.txt", "b.txt", "c.txt"):
                (root / name).write_text(name)
        lister = as_resumable(FileLister(str(old), abspath=abspath), ADAPTERS)
        it = iter(lister)
        next(it), next(it)
        state = {**lister.state_dict(), "root": str(new)}  # type: ignore[attr-defined]
        again = as_resumable(FileLister(str(new), abspath=abspath), ADAPTERS)
        again.load_state_dict(state)  # type: ignore[attr-defined]
        assert os.path.basename(next(iter(again))) == "c.txt"  # (then its source's roots, afresh)
        os.rename(new / "b.txt", new / "b2.txt")
        with pytest.raises(ChangedFileError, match=f"{new} lists other files"):
            again.load_state_dict(state)  # type: ignore[attr-defined]

    @parametrize("name", sorted(BUILDS))
    def test_a_datapipe_becomes_resumable_in_place_keeping_its_own_class_and_configuration(
        self, name: str
    ) -> None:
        """The resumable class is the original or extends it: it initializes nothing and the
        DataPipe keeps its identity, its configuration and its own methods (``len()``,
        ``set_seed``), and it pickles and unpickles as its original does."""
        top = BUILDS[name](IterableWrapper, self.tmp)
        original, configuration, length = type(top), dict(vars(top)), _length(top)
        assert as_resumable(top, ADAPTERS) is top
        kind = type(top)
        assert issubclass(kind, original) and (kind is original or "__init__" not in vars(kind))
        assert {k: v for k, v in vars(top).items() if k in configuration} == configuration
        again = pickle.loads(pickle.dumps(top))
        assert type(again) is kind and list(again) == list(top)
        assert _length(top) == length
        # Mid-iteration (an elastic resume's skips set), what the iteration holds is not pickled.
        if isinstance(top, Expander):
            top.skip_per_element(lambda: 0)
        it = iter(top)
        next(it)
        unpickled = pickle.loads(pickle.dumps(top))
        assert type(unpickled) is kind and sorted(map(repr, unpickled)) == sorted(map(repr, again))

    def test_a_shuffler_only_resets_otherwise(self) -> None:
        """Shuffler keeps its buffer and RNG in attributes: its resumable class iterates with the
        original's code, and a loaded state stands in for a reseed, which would draw another
        order, and, without a seed set, draw from torch's global generator too."""
        assert "__iter__" not in vars(ResumableShuffler)
        source = ResumableIterableWrapper(range(20))
        shuffler = ResumableShuffler.adapt(source.shuffle(buffer_size=6).set_seed(3))
        it = iter(shuffler)
        before = [next(it) for _ in range(9)]
        state, position = shuffler.state_dict(), source.state_dict()  # type: ignore[attr-defined]
        rest = list(it)
        assert sorted(before + rest) == list(range(20)) and before + rest != list(range(20))
        torch_state = torch.get_rng_state()  # (the seed was used: a reset would draw one)
        shuffler.load_state_dict(state)  # type: ignore[attr-defined]
        source.load_state_dict(position)
        assert list(shuffler) == rest
        assert torch.equal(torch.get_rng_state(), torch_state)

    def test_a_malformed_state_is_refused_when_loaded(self) -> None:
        with pytest.raises(ValueError, match="the state of ResumableIterableWrapper must have the fields"):
            ResumableIterableWrapper(range(3)).load_state_dict({"nonsense": 1})


instantiate_parametrized_tests(TestResumableDatapipes)


if __name__ == "__main__":
    unittest.main()
