"""A restore onto a pipeline whose function changed (its code, or a value it reads) is refused
naming the DataPipe and its function; one whose structure changed names the first DataPipe
that differs."""

from __future__ import annotations

import importlib
import shutil
import sys
import unittest
from typing import Any, Callable

import pytest
from pipelines import rs
from suite_case import SuiteTestCase
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot import IncompatibleCheckpointError, load_state_dict


def words() -> Any:
    return IterableWrapper(["a", "b", "c", "d", "e", "f", "g", "h"] * 4).sharding_filter()


class TestChangedPipeline(SuiteTestCase):
    # A user's code changed between the run that saved and the one that restores: a module
    # written again. (Lambdas and closures need dill to reach DataLoader2, which clones the graph by
    # pickling it; what they compute with is digested alike: see the tests above.) In the training
    # process (num_workers=0), which records the same identity as workers do.

    def user_module(self, source: str) -> Any:
        """The module ``user_transforms`` with ``source``, imported afresh."""
        folder = self.tmp_path / "code"
        folder.mkdir(exist_ok=True)
        (folder / "user_transforms.py").write_text(source)
        shutil.rmtree(folder / "__pycache__", ignore_errors=True)  # (a bytecode cache of the same second)
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
            self.addCleanup(sys.path.remove, str(folder))
        sys.modules.pop("user_transforms", None)
        self.addCleanup(sys.modules.pop, "user_transforms", None)
        importlib.invalidate_caches()
        return importlib.import_module("user_transforms")

    def state_with(self, fn: Callable[[str], str]) -> Any:
        dl = self.make_dl(words().map(fn), rs(0))
        it = iter(dl)
        for _ in range(5):
            next(it)
        return dl.state_dict()

    def restore_onto(self, state: Any, datapipe: Any) -> None:
        load_state_dict(self.make_dl(datapipe, rs(0)), state)

    def test_a_changed_function_body_is_refused_naming_the_datapipe_and_its_function(self) -> None:
        state = self.state_with(self.user_module("def transform(s):\n    return s.upper()\n").transform)
        changed = self.user_module("def transform(s):\n    return s.upper() + '!'\n").transform
        with pytest.raises(
            IncompatibleCheckpointError,
            match=r"DataPipe 0:MapperIterDataPipe: its function fn \(user_transforms\.transform\) computes "
            r"otherwise than in the checkpoint",
        ):
            self.restore_onto(state, words().map(changed))

    def test_a_changed_value_the_function_reads_is_refused_and_the_same_code_fits(self) -> None:
        code = "SUFFIX = {!r}\ndef transform(s):\n    return s + SUFFIX\n"
        state = self.state_with(self.user_module(code.format("!")).transform)
        with pytest.raises(IncompatibleCheckpointError, match=r"its function fn .*computes otherwise"):
            self.restore_onto(state, words().map(self.user_module(code.format("?")).transform))
        self.restore_onto(state, words().map(self.user_module(code.format("!")).transform))  # it fits

    def test_an_added_datapipe_is_refused_naming_the_first_that_differs(self) -> None:
        state = self.state_with(str.upper)
        with pytest.raises(
            IncompatibleCheckpointError,
            match=r"another pipeline \(the first DataPipe that differs is 1:FilterIterDataPipe, where the "
            r"checkpoint has 1:ShardingFilterIterDataPipe",
        ):
            self.restore_onto(state, words().filter(str.isalpha).map(str.upper))


if __name__ == "__main__":
    unittest.main()
