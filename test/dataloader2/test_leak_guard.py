"""The autouse guard of conftest.py fails a test that leaves a child process running."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

_LEAKY_TEST = """
import multiprocessing, time

def test_leaks_a_process():
    multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True).start()
"""


def test_the_guard_fails_a_test_that_leaves_a_process(pytester: pytest.Pytester, monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCHDATA_SNAPSHOT_LEFTOVER_WAIT_S", "1")
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=textwrap.dedent(_LEAKY_TEST))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--rootdir={pytester.path}")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the test left child processes running: pid *"])
