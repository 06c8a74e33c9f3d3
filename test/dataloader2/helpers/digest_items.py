"""Items whose memory is not their value, for the digest's tests: views with odd strides and
bits, arrays with padding. Module-level, so that spawned workers import them."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict

import numpy
import torch

from torchdata_snapshot.checkpoint.array_digest import SAMPLE_BYTES

#: A structured dtype with 7 bytes of padding after its first field.
ALIGNED = numpy.dtype([("a", "u1"), ("b", "f8")], align=True)


def conj_imag_item(x: int) -> Dict[str, Any]:
    """An item holding a view with the negative bit, one element and stride 2 (``is_contiguous()``
    holds for a 1-element tensor whatever its stride, and its bytes cannot be viewed in place)."""
    return {"i": x, "x": torch.tensor([complex(1, 2 + x)]).conj().imag}


def _scribbled(dtype: Any, n: int) -> Any:
    """An uninitialized array whose bytes are random: in particular its padding, which holds
    whatever the memory held, different in every process and every run."""
    out = numpy.empty(n, dtype)
    out.view(numpy.uint8)[...] = numpy.frombuffer(os.urandom(out.nbytes), numpy.uint8).reshape(
        out.view(numpy.uint8).shape
    )
    return out


def padded_arrays(x: int, n: int = 5) -> Dict[str, Any]:
    """Arrays of ``n`` elements with values from ``x`` and random padding: long doubles (6 of
    x87's 16 bytes are padding), complex long doubles, an aligned structured dtype and a nested
    one with subarray and long double fields, written as a ufunc or a field assignment writes them
    (value bytes only)."""
    long_double = numpy.divide(
        numpy.arange(x, x + n, dtype=numpy.longdouble), 3, out=_scribbled(numpy.longdouble, n)
    )
    complex_long_double = numpy.multiply(
        numpy.arange(x, x + n, dtype=numpy.clongdouble), 1 - 1j / 3, out=_scribbled(numpy.clongdouble, n)
    )
    aligned = _scribbled(ALIGNED, n)
    aligned["a"], aligned["b"] = numpy.arange(x, x + n) % 256, numpy.arange(x, x + n) / 7
    nested = _scribbled(
        numpy.dtype([("s", ALIGNED), ("v", "u2", (3,)), ("g", numpy.longdouble, (2,))], align=True), n
    )
    nested["s"] = aligned
    nested["v"] = numpy.arange(3 * n).reshape(n, 3) + x
    nested["g"] = long_double[:, None] * numpy.array([1, -1], dtype=numpy.longdouble)
    return {
        "longdouble": long_double,
        "clongdouble": complex_long_double,
        "aligned": aligned,
        "nested": nested,
    }


def padded_arrays_item(x: int) -> Dict[str, Any]:
    """An item holding arrays with random padding (see ``padded_arrays``)."""
    return {"i": x, **padded_arrays(x)}


def same_values(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and torch.equal(a.resolve_neg(), b.resolve_neg())
    if isinstance(a, numpy.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.names is not None:  # field by field (their padding differs)
            return all(same_values(a[name], b[name]) for name in a.dtype.names)
        return bool(numpy.array_equal(a, b))
    return bool(a == b)


class Node:
    """A tree node whose children point back at it, as parsed documents and scene graphs do."""

    def __init__(self, value: int, children: int = 0) -> None:
        self.value = value
        self.parent: Any = None
        self.children = [Node(value * 10 + c) for c in range(children)]
        for child in self.children:
            child.parent = self


def holding_itself_item(x: int) -> Dict[str, Any]:
    """An item that pickles but holds itself (``item["me"] is item``) and a tree with parent
    pointers: the digest walked the first forever and the second in exponential time."""
    item: Dict[str, Any] = {"i": x, "tree": Node(x, children=12)}
    item["me"] = item
    return item


def same_holding_itself(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    kids = [c.value for c in a["tree"].children], [c.value for c in b["tree"].children]
    return (
        a["i"] == b["i"]
        and a["me"] is a
        and b["me"] is b
        and kids[0] == kids[1]
        and all(c.parent is b["tree"] for c in b["tree"].children)
    )


def assert_every_sampled_byte_counts(digest: Callable[[Any], Any]) -> None:
    """A 64 KB item: a change of any one byte of the first and last ``SAMPLE_BYTES`` (every 97th
    one here) changes its ``digest``, and so does swapping two of its elements there."""
    item = torch.arange(8192, dtype=torch.int64)
    flat = item.view(torch.uint8)
    before = digest(item)
    for offset in [*range(0, SAMPLE_BYTES, 97), *range(len(flat) - SAMPLE_BYTES, len(flat), 97)]:
        changed = flat.clone()
        changed[offset] ^= 0x10
        assert digest(changed.view(torch.int64)) != before, offset
    swapped = item.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert digest(swapped) != before
