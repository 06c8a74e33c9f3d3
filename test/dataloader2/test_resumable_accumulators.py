"""The DataPipes that accumulate or count after the readers (webdataset, lines_to_paragraphs,
enumerate, add_index): resumable in place, a copy restored after each item yields the rest."""

from __future__ import annotations

import pickle

from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._compat.datapipes import samples_yielded
from torchdata_snapshot.graph_state.accumulators import ACCUMULATOR_ADAPTERS
from torchdata_snapshot.graph_state.resumable import Resumable, as_resumable


class TestResumableAccumulators(TestCase):
    @parametrize("name", ["enumerate", "add_index", "lines_to_paragraphs", "webdataset"])
    def test_what_accumulates_or_counts_becomes_resumable_in_place(self, name: str) -> None:
        """Those whose generator holds a count or what it accumulated become their resumable
        subclass, keeping their configuration; a copy restored after each item yields the rest."""
        lines = [("a.txt", "x"), ("a.txt", ""), ("a.txt", "y"), ("b.txt", "z")]
        members = [("s/1.jpg", "p"), ("s/1.cls", "q"), ("s/2.jpg", "r"), ("s/3.jpg", "t")]
        build = {
            "enumerate": lambda: IterableWrapper("abcd").enumerate(starting_index=5),
            "add_index": lambda: IterableWrapper([{"v": i} for i in range(4)]).add_index("at"),
            "lines_to_paragraphs": lambda: IterableWrapper(lines).lines_to_paragraphs(),
            "webdataset": lambda: IterableWrapper(members).webdataset(),
        }[name]
        everything, dp = list(build()), build()
        kind, configuration = type(dp), dict(vars(dp))
        assert (
            as_resumable(dp, ACCUMULATOR_ADAPTERS) is dp
            and isinstance(dp, kind)
            and isinstance(dp, Resumable)
        )
        assert type(dp) is kind or "__init__" not in vars(type(dp))
        assert {k: v for k, v in vars(dp).items() if k in configuration} == configuration
        source = dp.source_datapipe
        for k in range(len(everything) + 1):
            it = iter(dp)
            head = [next(it) for _ in range(k)]
            state, taken = dp.state_dict(), samples_yielded(source)
            unpickled = pickle.loads(pickle.dumps(dp))  # (what the iteration holds is not pickled)
            assert type(unpickled) is type(dp) and not set(dp.TRANSIENT) & set(vars(unpickled))
            again = as_resumable(build(), ACCUMULATOR_ADAPTERS)
            again.source_datapipe = IterableWrapper(list(source)[taken:])
            again.load_state_dict(state)
            assert head + list(again) == everything, f"restored after {k}"


instantiate_parametrized_tests(TestResumableAccumulators)
