"""function_digest: what a map or filter function computes with, the same in every process
that builds it, different when its code, defaults or the values it reads change."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import unittest
from pathlib import Path
from typing import Any, Callable

from torchdata_snapshot.checkpoint.function_digest import DIGEST_VERSION, function_digest, same_computation

SCALE = 2


def scaled(x: int, factor: int = 3) -> int:
    return x * factor * SCALE


def capturing(value: Any) -> Callable[[str], str]:
    return lambda s: s + str(value)


class TestFunctionDigest(unittest.TestCase):
    def test_the_same_code_has_the_same_digest_wherever_it_is_defined(self) -> None:
        first = lambda s: s.upper()  # noqa: E731
        again = lambda s: s.upper()  # noqa: E731 (another line, another object)
        assert function_digest(first) == function_digest(again)
        assert function_digest(first).startswith(f"{DIGEST_VERSION}:")  # type: ignore[union-attr]

    def test_a_changed_body_captured_value_default_or_global_changes_the_digest(self) -> None:
        assert function_digest(lambda s: s.upper()) != function_digest(lambda s: s.upper() + "!")
        assert function_digest(capturing(1)) != function_digest(capturing(2))
        assert function_digest(capturing(1)) == function_digest(capturing(1))
        with_default = functools.partial(scaled)
        assert function_digest(with_default) == function_digest(scaled)
        before = function_digest(scaled)
        global SCALE
        SCALE = 5
        try:
            assert function_digest(scaled) != before, "a global plain value it reads"
        finally:
            SCALE = 2

    def test_what_it_cannot_compare_counts_by_type(self) -> None:
        assert function_digest(capturing(object())) == function_digest(capturing(object()))
        assert function_digest(str.upper) is None and function_digest(len) is None

    def test_digests_of_other_python_versions_are_not_compared(self) -> None:
        ours = function_digest(scaled)
        assert same_computation(ours, ours) and not same_computation(
            ours, f"{DIGEST_VERSION}:0123456789abcdef"
        )
        assert same_computation(ours, "py2.7:0123456789abcdef"), "cannot say"
        assert same_computation(None, ours)

    def test_the_digest_is_the_same_in_a_process_with_another_hash_seed(self) -> None:
        """A set literal compiles to a frozenset constant, whose order follows string hashing."""
        code = (
            "import test_function_digest as t; "
            "print(t.function_digest(lambda s: s in {'alpha', 'beta', 'gamma', 'delta'}))"
        )
        here = Path(__file__).parent
        digests = set()
        for seed in ("1", "2", "3"):
            env = {
                **os.environ,
                "PYTHONHASHSEED": seed,
                "PYTHONPATH": os.pathsep.join([str(here), *sys.path]),
            }
            done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True,
                                  text=True, timeout=120, check=True)  # fmt: skip
            digests.add(done.stdout.strip())
        assert len(digests) == 1 and DIGEST_VERSION in digests.pop()

    # --- a restore onto a changed pipeline ------------------------------------------------------


if __name__ == "__main__":
    unittest.main()
