"""value_digest: a tensor's or array's digest is a function of its dtype, shape and values: never
of its strides, its conjugate or negative bits, or the padding bytes between and after its
elements' values; and the digests checkpoints of this format version recorded stay what they were."""

from __future__ import annotations

import unittest
import warnings
from typing import Any, Callable, Dict, List, Tuple

import numpy
import pytest
import torch
from digest_items import ALIGNED, padded_arrays
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot.checkpoint.array_digest import SAMPLE_BYTES, value_digest
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain

#: Whether long doubles are x87's 80-bit extended precision here (10 bytes of 12 or 16: padded).
_X87 = (numpy.finfo(numpy.longdouble).nmant, numpy.finfo(numpy.longdouble).nexp) == (63, 15)
_LONG = numpy.dtype(numpy.longdouble).itemsize


def test_conjugate_and_negative_views_digest_as_their_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert value_digest(z.conj()) == value_digest(z.conj().resolve_conj())
    x = torch.tensor([1.0, -2.0])
    assert value_digest(x._neg_view()) == value_digest(-x)
    assert value_digest(z.conj()) != value_digest(z)


def test_large_tensors_are_sampled_at_both_ends() -> None:
    big = torch.zeros(SAMPLE_BYTES)  # 4 bytes per element: larger than two samples
    changed_end = big.clone()
    changed_end[-1] = 1
    changed_middle = big.clone()
    changed_middle[len(big) // 2] = 1
    assert value_digest(big) != value_digest(changed_end)
    assert value_digest(big) == value_digest(changed_middle), "the middle of a large tensor is not read"


@pytest.mark.parametrize("digest", [value_digest, lambda t: chain(CHAIN_START, t)], ids=["value", "chain"])
def test_every_byte_sampled_counts(digest: Callable[[Any], Any]) -> None:
    """A 64 KB item: a change of any one byte of the first and last ``SAMPLE_BYTES`` (every 97th
    one here) changes its digest, and so does swapping two of its elements there."""
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


#: Digests that checkpoints of this format version (8: values as CRC-32s) hold: a restore
#: recomputes them, so they must not change within it (contiguous CPU tensors are read without a
#: copy, the others through a copy: both must feed the same bytes).
PINNED_TENSOR_DIGESTS = {
    "1 MB float32": (lambda: torch.arange(262144, dtype=torch.float32), "e6ca2af032f13d0b"),
    "small int64": (lambda: torch.arange(10), "a7fe72b49857d3ae"),
    "bool": (lambda: torch.tensor([True, False, True]), "a3073077f008248a"),
    "uint8, sampled": (lambda: torch.arange(20000, dtype=torch.int32).to(torch.uint8), "abb3a21a8afc2321"),
    "2-d float64": (lambda: torch.arange(3000, dtype=torch.float64).reshape(30, 100), "decd2c3abf12478d"),
    "transposed": (lambda: torch.arange(10000.0).reshape(100, 100).t(), "67ec6cad2c0e5599"),
    "float16": (lambda: torch.arange(5000, dtype=torch.float16), "74771885e37a5035"),
    "bfloat16 (no numpy dtype)": (lambda: torch.arange(5000, dtype=torch.bfloat16), "d8854f28d9a4c6ff"),
    "complex64": (lambda: torch.arange(3000, dtype=torch.float32).to(torch.complex64), "e52e6171bc2d90d1"),
    "empty": (lambda: torch.zeros(0), "ac6702e0d56eb9d6"),
    "0-d": (lambda: torch.tensor(3.5), "42a512113f500f4f"),
    "requires grad": (lambda: torch.ones(5000, requires_grad=True), "7ef1b6850c8f3b7d"),
    "slice of a larger storage": (lambda: torch.arange(100000.0)[1000:60000], "bb2241d049fa4729"),
}


@pytest.mark.parametrize("name", list(PINNED_TENSOR_DIGESTS))
def test_tensor_digests_stay_what_earlier_checkpoints_recorded(name: str) -> None:
    make, digest = PINNED_TENSOR_DIGESTS[name]
    assert value_digest(make()) == digest


#: Running digests of one plain tensor item (``chain``, what checkpoints record), pinned likewise.
PINNED_CHAINS = {
    "64 KB int64": (lambda: torch.arange(8192), 0xFA3A219100510DAD),
    "1 MB float32": (lambda: torch.arange(262144, dtype=torch.float32), 0xAA7B9332A8BC482A),
    "empty": (lambda: torch.zeros(0), 0x4FD67456252B4AE9),
}


@pytest.mark.parametrize("name", list(PINNED_CHAINS))
def test_running_digests_of_tensors_stay_what_checkpoints_recorded(name: str) -> None:
    make, digest = PINNED_CHAINS[name]
    assert chain(CHAIN_START, make()) == digest


def _zero_padded(a: numpy.ndarray, padding: slice) -> numpy.ndarray:
    a.view(numpy.uint8).reshape(a.size, a.dtype.itemsize)[:, padding] = 0
    return a


def _aligned_records(n: int) -> numpy.ndarray:
    records = _zero_padded(numpy.zeros(n, ALIGNED), slice(1, 8))
    records["a"], records["b"] = numpy.arange(n) % 256, numpy.arange(n) / 7
    return records


#: Digests of arrays that earlier checkpoints hold, as for tensors: arrays of plain dtypes, and
#: C-contiguous arrays whose padding was zero (the only ones with padding that restored then).
PINNED_ARRAY_DIGESTS = {
    "float64, sampled": (lambda: numpy.arange(3000, dtype=numpy.float64), "2eefc2f9f8489c8b"),
    "Fortran order": (
        lambda: numpy.asfortranarray(numpy.arange(3000, dtype=numpy.int32).reshape(30, 100)),
        "68a0c83d2fa257e5",
    ),
    "reversed": (lambda: numpy.arange(3000.0)[::-1], "403b2cd746584fcf"),
    "0-d": (lambda: numpy.array(2.5), "c9abe252dd66be24"),
    "unicode": (lambda: numpy.array(["ab", "c"]), "2719a5be68ee99de"),
    "aligned structured, zero padding": (lambda: _aligned_records(3000), "1e64c790b58a5918"),
}
if _X87 and _LONG == 16:
    PINNED_ARRAY_DIGESTS["longdouble, zero padding"] = (
        lambda: _zero_padded(numpy.arange(3000, dtype=numpy.longdouble) / 7, slice(10, 16)),
        "55f636cc8535c13d",
    )


@pytest.mark.parametrize("name", list(PINNED_ARRAY_DIGESTS))
def test_array_digests_stay_what_earlier_checkpoints_recorded(name: str) -> None:
    make, digest = PINNED_ARRAY_DIGESTS[name]
    assert value_digest(make()) == digest


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
        # The running digest of a stream (a plain tensor: array_digest.tensor_hash, no hash object).
        running = chain(CHAIN_START, item)
        self.assertEqual(running, chain(CHAIN_START, plain), "equal values chain equally")
        self.assertNotEqual(running, chain(CHAIN_START, changed), "another value changes the chain")


#: ``(dtype, byte offsets of an element's padding)``: structured dtypes; long doubles where x87's
#: 80-bit format fills 10 of their bytes (elsewhere they have no padding).
PADDED: Dict[str, Tuple[numpy.dtype, List[int]]] = {
    "aligned structured": (ALIGNED, list(range(1, 8))),
    "structured with an itemsize beyond its fields": (
        numpy.dtype({"names": ["a", "b"], "formats": ["<i4", "u1"], "offsets": [0, 4], "itemsize": 12}),
        list(range(5, 12)),
    ),
    "overlapping fields": (
        numpy.dtype({"names": ["a", "b"], "formats": ["<u2", "<u4"], "offsets": [0, 0], "itemsize": 8}),
        list(range(4, 8)),
    ),
    "longdouble": (numpy.dtype(numpy.longdouble), list(range(10, _LONG))),
    "clongdouble": (numpy.dtype(numpy.clongdouble), [*range(10, _LONG), *range(_LONG + 10, 2 * _LONG)]),
    "byte-swapped longdouble": (numpy.dtype(numpy.longdouble).newbyteorder(), list(range(0, _LONG - 10))),
    "structured with subarray and longdouble fields": (
        numpy.dtype([("s", ALIGNED), ("v", "<u2", (3,)), ("g", numpy.longdouble, (2,))], align=True),
        [*range(1, 8), *range(22, 32), *range(42, 48), *range(58, 64)],
    ),
}


@instantiate_parametrized_tests
class TestPaddingIsNeverHashed(unittest.TestCase):
    @parametrize("name", list(PADDED))
    @parametrize("count", [5, 3000])  # read whole, sampled
    def test_equal_values_with_other_padding_digest_equally(self, name: str, count: int) -> None:
        dtype, padding = PADDED[name]
        if dtype.kind in "fc" and not _X87:
            self.skipTest("long double has no padding on this platform")
        values = numpy.zeros(count, dtype)
        values.view(numpy.uint8).reshape(count, dtype.itemsize)[:, :] = numpy.arange(dtype.itemsize) % 251 + 1
        values.view(numpy.uint8).reshape(count, dtype.itemsize)[:, padding] = 0
        if dtype.kind in "fc":  # finite values (random bytes may make NaNs with their own payloads)
            values[...] = numpy.arange(count) / 3
        scribbled = values.copy()
        scribbled.view(numpy.uint8).reshape(count, dtype.itemsize)[:, padding] = 0xA5
        self.assertTrue((scribbled.view(numpy.uint8) != values.view(numpy.uint8)).any())
        for a, b in ((values, scribbled), (values[::-1], scribbled[::-1])):
            self.assertEqual(value_digest(a), value_digest(b))
        changed = scribbled.copy()
        changed.view(numpy.uint8).reshape(count, dtype.itemsize)[
            -1, 0 if 0 not in padding else _LONG - 1
        ] ^= 1
        self.assertNotEqual(value_digest(changed), value_digest(scribbled))


class Opaque(torch.Tensor):
    """A tensor subclass that refuses the operations a digest reads a tensor with (it pickles)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.detach, torch.Tensor.copy_):
            raise RuntimeError("opaque")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_that_cannot_be_read_digests_by_its_type_and_shape() -> None:
    """A missed divergence, never a crash (the worker would die) and never a false alarm."""
    opaque = torch.arange(3.0).as_subclass(Opaque)
    assert value_digest(opaque) == value_digest(torch.arange(3.0).as_subclass(Opaque))
    assert value_digest(opaque) != value_digest(torch.arange(4.0).as_subclass(Opaque))
