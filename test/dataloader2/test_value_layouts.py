"""A tensor or array digests as its values, whatever its layout and dtype (strides, views,
conjugate and negative bits, quantized, sparse and nested layouts, padded arrays): on its own
(``value_digest``) and in a stream's running digest (``chain``, which takes a plain tensor item
by a faster path than the others)."""

from __future__ import annotations

import unittest
import warnings
from typing import Any, Callable, Dict, Tuple

import numpy
import torch
from digest_items import padded_arrays
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot.checkpoint.array_digest import value_digest
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain

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


@instantiate_parametrized_tests
class TestDigestOfValues(unittest.TestCase):
    @parametrize("name", list(CASES))
    def test_a_layout_digests_as_a_plain_copy_of_its_values(self, name: str) -> None:
        with warnings.catch_warnings():  # prototype and beta layouts, experimental dtypes
            warnings.simplefilter("ignore")
            item, plain, changed = CASES[name]()
        digest = value_digest(item)
        self.assertEqual(digest, value_digest(plain), "equal values digest equally, whatever the layout")
        self.assertNotEqual(digest, value_digest(changed), "another value changes the digest")
        running = chain(CHAIN_START, item)
        self.assertEqual(running, chain(CHAIN_START, plain), "equal values chain equally")
        self.assertNotEqual(running, chain(CHAIN_START, changed), "another value changes the chain")
