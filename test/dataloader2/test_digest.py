"""item_digest: equal items give equal digests in every process; different items differ."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import namedtuple
from typing import Any, List

import numpy
import pytest
import torch

from torchdata_snapshot._digest import SAMPLE_BYTES, item_digest

Point = namedtuple("Point", "x y")


class Record:
    def __init__(self, name: str, values: List[int]) -> None:
        self.name = name
        self.values = values


def samples() -> List[Any]:
    return [
        0, -7, 2**70, 1.5, float("nan"), "text", "", b"\x00bytes", bytearray(b"ba"), None, True, False,
        (1, "a"), [1, [2, [3]]], {"k": 1, "j": [2]}, {"apple", "pear", "plum"}, frozenset({"x", "y"}),
        Point(1, 2), Record("r", [1, 2]),
        torch.arange(10), torch.zeros(2, 3, dtype=torch.bool), torch.arange(12.0).reshape(3, 4).t(),
        torch.ones(0), torch.tensor([1.5], dtype=torch.bfloat16),
        numpy.arange(6).reshape(2, 3), numpy.array(["a", "b"], dtype=object),
    ]  # fmt: skip


def test_digests_are_16_hex_digits_and_deterministic() -> None:
    for item in samples():
        d = item_digest(item)
        assert len(d) == 16 and int(d, 16) >= 0
        assert item_digest(item) == d


def test_different_items_have_different_digests() -> None:
    digests = [item_digest(x) for x in samples()]
    assert len(set(digests)) == len(digests)
    assert item_digest({"a": 1, "b": 2}) != item_digest({"b": 2, "a": 1}), "dict order is part of the item"
    assert item_digest(torch.arange(4)) != item_digest(torch.arange(4).float())
    assert item_digest(torch.arange(4)) != item_digest(torch.arange(4).reshape(2, 2))
    assert item_digest(Record("r", [1, 2])) != item_digest(Record("r", [1, 3]))


def test_conjugate_and_negative_views_digest_as_their_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert item_digest(z.conj()) == item_digest(z.conj().resolve_conj())
    x = torch.tensor([1.0, -2.0])
    assert item_digest(x._neg_view()) == item_digest(-x)
    assert item_digest(z.conj()) != item_digest(z)


def test_large_tensors_are_sampled_at_both_ends() -> None:
    big = torch.zeros(SAMPLE_BYTES)  # 4 bytes per element: larger than two samples
    changed_end = big.clone()
    changed_end[-1] = 1
    changed_middle = big.clone()
    changed_middle[len(big) // 2] = 1
    assert item_digest(big) != item_digest(changed_end)
    assert item_digest(big) == item_digest(changed_middle), "the middle of a large tensor is not read"


_CHILD = """
import sys, pickle
sys.path.insert(0, {path!r})
from test_digest import samples
from torchdata_snapshot._digest import item_digest
print(",".join(item_digest(x) for x in samples()))
"""


@pytest.mark.parametrize("hash_seed", ["1", "2"])
def test_digests_agree_across_processes_with_other_hash_salts(hash_seed: str) -> None:
    # Sets of strings iterate in an order that depends on the per-process hash salt.
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONWARNINGS="ignore")
    code = _CHILD.format(path=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == [item_digest(x) for x in samples()]


#: Digests that checkpoints written by earlier versions hold: a restore recomputes them, so they
#: must never change (contiguous CPU tensors are read without a copy, the others through a copy:
#: both must feed the same bytes).
PINNED_TENSOR_DIGESTS = {
    "1 MB float32": (lambda: torch.arange(262144, dtype=torch.float32), "41fb3b944e635a71"),
    "small int64": (lambda: torch.arange(10), "d26208f4f3627d11"),
    "bool": (lambda: torch.tensor([True, False, True]), "1d09530e852c70c3"),
    "uint8, sampled": (lambda: torch.arange(20000, dtype=torch.int32).to(torch.uint8), "f308d8f56c499540"),
    "2-d float64": (lambda: torch.arange(3000, dtype=torch.float64).reshape(30, 100), "4e549038bff2dbf3"),
    "transposed": (lambda: torch.arange(10000.0).reshape(100, 100).t(), "c8f838c8ed8377bf"),
    "float16": (lambda: torch.arange(5000, dtype=torch.float16), "3cddcdc975fb2868"),
    "bfloat16 (no numpy dtype)": (lambda: torch.arange(5000, dtype=torch.bfloat16), "034ca937432dbc6d"),
    "complex64": (lambda: torch.arange(3000, dtype=torch.float32).to(torch.complex64), "4a841717b2a8da7a"),
    "empty": (lambda: torch.zeros(0), "ac6702e0d56eb9d6"),
    "0-d": (lambda: torch.tensor(3.5), "ce2d36ba83356ead"),
    "requires grad": (lambda: torch.ones(5000, requires_grad=True), "3c63369fd7e78c62"),
    "slice of a larger storage": (lambda: torch.arange(100000.0)[1000:60000], "12c8f1d10372c724"),
}


@pytest.mark.parametrize("name", list(PINNED_TENSOR_DIGESTS))
def test_tensor_digests_stay_what_earlier_checkpoints_recorded(name: str) -> None:
    make, digest = PINNED_TENSOR_DIGESTS[name]
    assert item_digest(make()) == digest
