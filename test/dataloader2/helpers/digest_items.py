"""Items whose memory is not their value, for the digest's tests: views with odd strides and
bits, arrays with padding, and the layouts and dtypes a tensor or array can have (``CASES``).
Module-level, so that spawned workers import them."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Tuple

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


# --- any layout, any dtype: the values count, not the memory ------------------------------------

#: A case: the item, a copy of it with the same values laid out plainly, a copy with another value.
Case = Tuple[Any, Any, Any]


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with ``t``'s values, no conjugate or negative bit, standard strides."""
    return t.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)


def _flip_last_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous ``t`` whose last element has its lowest bit flipped: another value."""
    changed = t.clone()
    changed.reshape(-1)[-1:].view(torch.uint8)[0] ^= 1
    return changed


def _tensor_case(make: Callable[[], torch.Tensor]) -> Callable[[], Case]:
    def case() -> Case:
        t = make()
        return t, _plain_tensor(t), _flip_last_tensor(_plain_tensor(t))

    return case


def _flip_last_array(a: numpy.ndarray) -> numpy.ndarray:
    """A C-contiguous copy of ``a`` whose last element has bit 0 of its first byte flipped (a
    value byte for every dtype here: little-endian numbers, a structure's first field)."""
    changed = numpy.array(a, order="C")
    changed.reshape(-1)[-1:].view(numpy.uint8)[0] ^= 1
    return changed


def _array_case(make: Callable[[], numpy.ndarray]) -> Callable[[], Case]:
    def case() -> Case:
        a = make()
        return a, numpy.array(a, order="C"), _flip_last_array(a)

    return case


def _quantized_case() -> Case:
    x = torch.arange(24.0).reshape(4, 6) / 10
    changed = x.clone()
    changed[-1, -1] += 1

    def quantize(v: torch.Tensor) -> torch.Tensor:
        return torch.quantize_per_tensor(v, 0.1, 3, torch.quint8)

    return quantize(x).t(), quantize(x).t().contiguous(), quantize(changed).t()


def _per_channel_quantized_case() -> Case:
    x = torch.arange(24.0).reshape(4, 6) / 10
    scales, zero_points = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 1, 2, 3])
    q = torch.quantize_per_channel(x, scales, zero_points, 0, torch.qint8)
    rescaled = torch.quantize_per_channel(x, scales * 2, zero_points, 0, torch.qint8)
    return q, q.clone(), rescaled


def _sparse_coo_case() -> Case:
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 2, 0], [1, 1, 1]]), torch.tensor([1.0, 2.0, 3.0]), (3, 3)
    )
    coalesced = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 1]]), torch.tensor([4.0, 2.0]), (3, 3))
    changed = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 1]]), torch.tensor([4.0, 2.5]), (3, 3))
    return uncoalesced, coalesced, changed


def _compressed_case(convert: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Case]:
    def case() -> Case:
        x = torch.tensor(
            [[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 5.0], [0.0, 6.0, 0.0, 0.0]]
        )
        changed = x.clone()
        changed[3, 1] = 7.0
        return convert(x), convert(x.t().contiguous().t()), convert(changed)

    return case


def _nested_case(layout: Any) -> Callable[[], Case]:
    def case() -> Case:
        parts = [torch.arange(6.0).reshape(2, 3), torch.arange(9.0).reshape(3, 3)]
        changed = [parts[0], parts[1] + 1]
        return tuple(  # type: ignore[return-value]
            torch.nested.nested_tensor([p.clone() for p in ps], layout=layout)
            for ps in (parts, parts, changed)
        )

    return case


def _long_double(n: int) -> numpy.ndarray:
    return padded_arrays(0, n)["longdouble"]


#: Layouts and dtypes a tensor or array can have: each digests as a plain copy of its values.
CASES: Dict[str, Callable[[], Case]] = {
    # tensors: views whose memory is not their values laid out plainly
    "conj().imag: 1 element, stride 2, negative bit": _tensor_case(
        lambda: torch.tensor([1 + 2j]).conj().imag
    ),
    "bfloat16, 1 element, stride 2": _tensor_case(
        lambda: torch.tensor([1.0, 2.0], dtype=torch.bfloat16)[::2]
    ),
    "float8, 1 element, stride 3": _tensor_case(lambda: torch.arange(4.0).to(torch.float8_e4m3fn)[1::3]),
    "complex32, 1 element, stride 2, conjugate": _tensor_case(
        lambda: torch.tensor([1 + 2j, 3 + 4j]).to(torch.complex32)[::2].conj()
    ),
    "expand (0-strides)": _tensor_case(lambda: torch.arange(3.0).expand(4, 3)),
    "expand, sampled": _tensor_case(lambda: torch.arange(3000.0).expand(50, 3000)),
    "transposed, sampled": _tensor_case(lambda: torch.arange(40000.0).reshape(200, 200).t()),
    "channels_last": _tensor_case(
        lambda: torch.arange(120.0).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last)
    ),
    "channels_last, sampled": _tensor_case(
        lambda: torch.arange(24000.0).reshape(2, 3, 40, 100).to(memory_format=torch.channels_last)
    ),
    "negative bit": _tensor_case(lambda: torch.arange(5.0)._neg_view()),
    "conjugate, sampled": _tensor_case(lambda: (torch.arange(5000.0) * (1 + 1j)).to(torch.complex64).conj()),
    "conjugate of a transpose, sampled": _tensor_case(
        lambda: (torch.arange(6000.0).reshape(60, 100) * 1j).to(torch.complex64).t().conj()
    ),
    "0-d": _tensor_case(lambda: torch.tensor(2.5)),
    "requires grad, transposed": _tensor_case(lambda: torch.ones(3, 4, requires_grad=True).t()),
    "nn.Parameter": _tensor_case(lambda: torch.nn.Parameter(torch.arange(5.0))),
    **{
        f"{dtype}, {layout}": _tensor_case(
            lambda dtype=dtype, n=n: torch.arange(2 * n).remainder(7).reshape(2, n).to(dtype).t()
        )
        for dtype in (
            torch.bool,
            torch.uint8,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.complex32,
            torch.complex64,
            torch.complex128,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.float8_e4m3fnuz,
            torch.float8_e5m2fnuz,
        )  # fmt: skip
        for layout, n in (("transposed", 6), ("transposed, sampled", 5000))
    },
    "uint16, contiguous": _tensor_case(lambda: torch.arange(10).to(torch.uint16)),
    "complex32, contiguous": _tensor_case(lambda: torch.arange(10).to(torch.complex32)),
    "float8, contiguous, sampled": _tensor_case(
        lambda: torch.arange(10000).remainder(9).to(torch.float8_e5m2)
    ),
    "quantized per tensor, transposed": _quantized_case,
    "quantized per channel": _per_channel_quantized_case,
    "sparse COO, uncoalesced": _sparse_coo_case,
    "sparse CSR": _compressed_case(lambda x: x.to_sparse_csr()),
    "sparse CSC": _compressed_case(lambda x: x.to_sparse_csc()),
    "sparse BSR": _compressed_case(lambda x: x.to_sparse_bsr((2, 2))),
    "sparse BSC": _compressed_case(lambda x: x.to_sparse_bsc((2, 2))),
    "nested": _nested_case(torch.strided),
    "nested, jagged": _nested_case(torch.jagged),
    # arrays
    "negative strides": _array_case(lambda: numpy.arange(10.0)[::-1]),
    "1 element, negative stride": _array_case(lambda: numpy.arange(4.0)[::-3][:1]),
    "Fortran order": _array_case(lambda: numpy.asfortranarray(numpy.arange(12.0).reshape(3, 4))),
    "broadcast (0-strides), sampled": _array_case(
        lambda: numpy.broadcast_to(numpy.arange(1000.0), (30, 1000))
    ),
    "0-d array": _array_case(lambda: numpy.array(3.5)),
    "longdouble": _array_case(lambda: _long_double(5)),
    "longdouble, reversed, sampled": _array_case(lambda: _long_double(3000)[::-1]),
    "clongdouble": _array_case(lambda: padded_arrays(1)["clongdouble"]),
    "aligned structured": _array_case(lambda: padded_arrays(2)["aligned"]),
    "aligned structured, Fortran order": _array_case(
        lambda: numpy.asfortranarray(padded_arrays(2, 12)["aligned"].reshape(3, 4))
    ),
    "nested structured with subarray fields, sampled": _array_case(
        lambda: padded_arrays(3, 3000)["nested"][::2]
    ),
    "packed structured": _array_case(lambda: numpy.zeros(4, numpy.dtype([("a", "u1"), ("b", "<f8")]))[::-1]),
    "datetime64": _array_case(lambda: numpy.arange(0, 6, dtype="datetime64[s]")[::2]),
    "timedelta64": _array_case(lambda: numpy.arange(0, 6, dtype="timedelta64[ms]")[::-1]),
    "unicode": _array_case(lambda: numpy.array(["ab", "c", "def"])[::-1]),
    "bytes": _array_case(lambda: numpy.array([b"ab", b"c", b"def"])[::2]),
    "void": _array_case(lambda: numpy.frombuffer(bytes(range(12)), "V3")[::-1]),
    "bool array": _array_case(lambda: numpy.array([True, False, True])[::-1]),
    "float16 array": _array_case(lambda: numpy.arange(6, dtype=numpy.float16)[::-1]),
}
