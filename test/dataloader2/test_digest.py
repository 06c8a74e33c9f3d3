"""item_digest: equal items give equal digests in every process; different items differ;
objects count by their content (tensors and arrays by their values: see test_array_digest)."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import decimal
import enum
import fractions
import os
import pathlib
import subprocess
import sys
import threading
import unittest
from collections import namedtuple
from typing import Any, Dict, List

import numpy
import pytest
import torch
from digest_items import Node, assert_every_sampled_byte_counts, padded_arrays
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize

from torchdata_snapshot._errors import ReplayDivergenceError
from torchdata_snapshot.checkpoint.array_digest import value_digest
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain, item_digest
from torchdata_snapshot.checkpoint.replay import replay

Point = namedtuple("Point", "x y")

#: Whether long doubles are x87's 80-bit extended precision here (10 bytes of 12 or 16: padded).
_X87 = (numpy.finfo(numpy.longdouble).nmant, numpy.finfo(numpy.longdouble).nexp) == (63, 15)
_LONG = numpy.dtype(numpy.longdouble).itemsize


class Record:
    def __init__(self, name: str, values: List[int]) -> None:
        self.name = name
        self.values = values


def samples() -> List[Any]:
    return [
        0, -7, 2**70, 1.5, float("nan"), "text", "", b"\x00bytes", bytearray(b"ba"), None, True, False,
        (1, "a"), [1, [2, [3]]], {"k": 1, "j": [2]}, {"apple", "pear", "plum"}, frozenset({"x", "y"}),
        Point(1, 2), Record("r", [1, 2]), {"big": 10**5000}, {"big": -(10**5000) - 1},  # past str()'s limit
        torch.arange(10), torch.zeros(2, 3, dtype=torch.bool), torch.arange(12.0).reshape(3, 4).t(),
        torch.ones(0), torch.tensor([1.5], dtype=torch.bfloat16),
        numpy.arange(6).reshape(2, 3), numpy.array(["a", "b"], dtype=object),
        torch.tensor([1 + 2j]).conj().imag,  # 1 element, stride 2, negative bit
        *padded_arrays(7).values(),  # their padding is random: different in every process
        padded_arrays(3, n=2000)["nested"][::-3],  # sampled, strided
        numpy.float64(1.5), numpy.float32(1.5), numpy.int64(7), numpy.longdouble(2.5),  # scalars
        datetime.datetime(2026, 12, 2, 19, 0), decimal.Decimal("1.5"), fractions.Fraction(1, 3),
        Slotted(1, "a"), Color.RED, pathlib.PurePosixPath("data", "shard0.txt"),  # no __dict__
    ]  # fmt: skip


@dataclasses.dataclass
class Slotted:
    """A dataclass with ``__slots__``, no ``__dict__`` (written out: ``dataclass(slots=True)`` needs 3.10)."""

    __slots__ = ("number", "name")
    number: int
    name: str


class Color(enum.Enum):
    RED = 1
    GREEN = 2


class TestObjectsWithoutADict(TestCase):
    """Numpy scalars count by their value, objects without ``__dict__`` (slots, C types) by what
    they pickle with: a change in either is a change of the digest, not only a change of type."""

    def test_a_changed_value_changes_the_digest(self) -> None:
        pairs = [
            (numpy.float64(1.5), numpy.float64(2.5)),
            (numpy.longdouble(1.5), numpy.longdouble(2.5)),
            (datetime.datetime(2026, 1, 1), datetime.datetime(2026, 1, 2)),
            (decimal.Decimal("1.5"), decimal.Decimal("1.6")),
            (fractions.Fraction(1, 3), fractions.Fraction(2, 3)),
            (Slotted(1, "a"), Slotted(1, "b")),
            (Color.RED, Color.GREEN),
            (pathlib.PurePosixPath("a"), pathlib.PurePosixPath("b")),
        ]
        for one, other in pairs:
            self.assertNotEqual(item_digest(one), item_digest(other), one)
            self.assertEqual(item_digest(one), item_digest(copy.deepcopy(one)), one)

    def test_an_object_that_does_not_pickle_counts_by_its_type(self) -> None:
        self.assertEqual(item_digest(threading.Lock()), item_digest(threading.Lock()))


_CHILD = """
import sys, pickle
sys.path[:0] = {path!r}
from test_digest import samples
from torchdata_snapshot.checkpoint.digest import item_digest
print(",".join(item_digest(x) for x in samples()))
"""


def divergence() -> str:
    with pytest.raises(ReplayDivergenceError) as raised:
        replay(iter([1, 2, 3]), 0, 3, 0, "0" * 16, where="worker 0", epoch=1)
    return str(raised.value)


class TestItemsThatHoldThemselves(TestCase):
    """A container or object met again inside itself counts as a reference to the enclosing one:
    the walk ends, visits each object once per path, and is the same in every process."""

    def test_an_item_that_holds_itself_has_a_digest(self) -> None:
        d: Dict[str, Any] = {"x": 1}
        d["me"] = d
        loop: List[Any] = [1, 2]
        loop.append(loop)
        for item in (d, loop, [loop, loop], (loop,)):
            self.assertEqual(item_digest(item), item_digest(copy.deepcopy(item)))
            self.assertEqual(chain(CHAIN_START, item), chain(CHAIN_START, copy.deepcopy(item)))
        other: Dict[str, Any] = {"x": 2}
        other["me"] = other
        self.assertNotEqual(item_digest(d), item_digest(other))

    def test_parent_pointers_are_walked_once(self) -> None:
        # 12 children pointing at their parent: the walk was exponential (4 took 23 s).
        tree = Node(1, children=12)
        changed = Node(1, children=12)
        changed.children[-1].value = -1
        self.assertEqual(item_digest(tree), item_digest(copy.deepcopy(tree)))
        self.assertNotEqual(item_digest(tree), item_digest(changed))

    def test_deeply_nested_lists_digest_in_both_paths(self) -> None:
        deep: List[Any] = [0]
        for _ in range(200):
            deep = [deep]
        self.assertEqual(chain(CHAIN_START, deep), chain(CHAIN_START, copy.deepcopy(deep)))


#: Running digests of one plain tensor item (``chain``, what checkpoints record), pinned as the value
#: digests are (test_array_digest.py): a restore recomputes them.
PINNED_CHAINS = {
    "64 KB int64": (lambda: torch.arange(8192), 0xFA3A219100510DAD),
    "1 MB float32": (lambda: torch.arange(262144, dtype=torch.float32), 0xAA7B9332A8BC482A),
    "empty": (lambda: torch.zeros(0), 0x4FD67456252B4AE9),
}


class TestDigest(SuiteTestCase):
    def test_digests_are_16_hex_digits_and_deterministic(self) -> None:
        for item in samples():
            d = item_digest(item)
            assert len(d) == 16 and int(d, 16) >= 0
            assert item_digest(item) == d

    def test_different_items_have_different_digests(self) -> None:
        digests = [item_digest(x) for x in samples()]
        assert len(set(digests)) == len(digests)
        assert item_digest({"a": 1, "b": 2}) != item_digest({"b": 2, "a": 1}), (
            "dict order is part of the item"
        )
        assert item_digest(torch.arange(4)) != item_digest(torch.arange(4).float())
        assert item_digest(torch.arange(4)) != item_digest(torch.arange(4).reshape(2, 2))
        assert item_digest(Record("r", [1, 2])) != item_digest(Record("r", [1, 3]))

    @parametrize("hash_seed", ["1", "2"])
    def test_digests_agree_across_processes_with_other_hash_salts(self, hash_seed: str) -> None:
        # Sets of strings iterate in an order that depends on the per-process hash salt.
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONWARNINGS="ignore")
        code = _CHILD.format(path=sys.path)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().split(",") == [item_digest(x) for x in samples()]

    def test_an_object_array_counts_by_its_objects(self) -> None:
        items = [numpy.array([1, "a"], dtype=object), numpy.array([1, "a"], dtype=object)[::-1]]
        assert item_digest(items[0]) == item_digest(numpy.array([1, "a"], dtype=object))
        assert item_digest(items[1]) == item_digest(numpy.array(["a", 1], dtype=object))
        assert item_digest(items[0]) != item_digest(items[1])

    def test_a_tensor_or_array_item_digests_as_its_values(self) -> None:
        for value in (torch.arange(12.0).reshape(3, 4).t(), numpy.arange(6).reshape(2, 3)[::-1]):
            assert item_digest(value) == value_digest(value)
        assert item_digest([torch.arange(3)]) != value_digest(torch.arange(3)), "a list is more than its item"

    def test_a_divergence_says_pythonhashseed_is_not_set_and_what_verify_replay_false_costs(self) -> None:
        self.monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        message = divergence()
        assert message.startswith("worker 0: items 1..3 of epoch 1 replayed differently")
        assert (
            "PYTHONHASHSEED is not set, so hash() of a str or bytes differs from one process to the next"
            in message
        )
        assert "a tokenizer, a bucketing or a sampling that uses hash() does not replay" in message
        assert "an unseeded source of randomness" in message and "a file read that changed" in message
        assert "verify_replay=False only turns this check off" in message
        assert "other data than the interrupted run's" in message
        assert "to continue anyway" not in message, "turning the check off is not the fix"
        assert message.endswith("(troubleshooting: docs/troubleshooting.rst#replaydivergenceerror)")

    def test_a_divergence_with_pythonhashseed_set_says_it_must_have_been_the_same(self) -> None:
        self.monkeypatch.setenv("PYTHONHASHSEED", "7")
        message = divergence()
        assert "hash() of a str or bytes is fixed here (PYTHONHASHSEED=7)" in message
        assert "the same PYTHONHASHSEED" in message
        assert os.environ["PYTHONHASHSEED"] == "7"

    def test_a_replayed_stream_that_ends_early_names_the_causes_too(self) -> None:
        with pytest.raises(
            ReplayDivergenceError, match="ended after 2 items.*Usual causes: .*PYTHONHASHSEED"
        ):
            replay(iter([1, 2]), 0, 3, None, None, where="worker 0", epoch=1)

    def test_every_byte_sampled_counts_in_the_running_digest(self) -> None:
        assert_every_sampled_byte_counts(lambda t: chain(CHAIN_START, t))

    @parametrize("name", list(PINNED_CHAINS))
    def test_running_digests_of_tensors_stay_what_checkpoints_recorded(self, name: str) -> None:
        make, digest = PINNED_CHAINS[name]
        assert chain(CHAIN_START, make()) == digest


instantiate_parametrized_tests(TestDigest)


if __name__ == "__main__":
    unittest.main()
