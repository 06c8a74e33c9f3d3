"""value_digest: a tensor's or array's digest is a function of its dtype, shape and values: never
of its strides, its conjugate or negative bits, or the padding bytes between and after its
elements' values; and the digests checkpoints of this format version recorded stay what they were."""

from __future__ import annotations

import unittest
from typing import Any, Dict, List, Tuple

import numpy
import torch
from digest_items import ALIGNED, assert_every_sampled_byte_counts
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot.checkpoint.array_digest import SAMPLE_BYTES, value_digest

#: Whether long doubles are x87's 80-bit extended precision here (10 bytes of 12 or 16: padded).
_X87 = (numpy.finfo(numpy.longdouble).nmant, numpy.finfo(numpy.longdouble).nexp) == (63, 15)
_LONG = numpy.dtype(numpy.longdouble).itemsize


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


class TestArrayDigest(SuiteTestCase):
    def test_conjugate_and_negative_views_digest_as_their_values(self) -> None:
        z = torch.tensor([1 + 2j, 3 - 1j])
        assert value_digest(z.conj()) == value_digest(z.conj().resolve_conj())
        x = torch.tensor([1.0, -2.0])
        assert value_digest(x._neg_view()) == value_digest(-x)
        assert value_digest(z.conj()) != value_digest(z)

    def test_large_tensors_are_sampled_at_both_ends(self) -> None:
        big = torch.zeros(SAMPLE_BYTES)  # 4 bytes per element: larger than two samples
        changed_end = big.clone()
        changed_end[-1] = 1
        changed_middle = big.clone()
        changed_middle[len(big) // 2] = 1
        assert value_digest(big) != value_digest(changed_end)
        assert value_digest(big) == value_digest(changed_middle), "the middle of a large tensor is not read"

    def test_every_byte_sampled_counts(self) -> None:
        """A 64 KB item: a change of any one byte of the first and last ``SAMPLE_BYTES`` (every 97th
        one here) changes its digest, and so does swapping two of its elements there."""
        assert_every_sampled_byte_counts(value_digest)

    @parametrize("name", list(PINNED_TENSOR_DIGESTS))
    def test_tensor_digests_stay_what_earlier_checkpoints_recorded(self, name: str) -> None:
        make, digest = PINNED_TENSOR_DIGESTS[name]
        assert value_digest(make()) == digest

    @parametrize("name", list(PINNED_ARRAY_DIGESTS))
    def test_array_digests_stay_what_earlier_checkpoints_recorded(self, name: str) -> None:
        make, digest = PINNED_ARRAY_DIGESTS[name]
        assert value_digest(make()) == digest

    def test_a_tensor_that_cannot_be_read_digests_by_its_type_and_shape(self) -> None:
        """A missed divergence, never a crash (the worker would die) and never a false alarm."""
        opaque = torch.arange(3.0).as_subclass(Opaque)
        assert value_digest(opaque) == value_digest(torch.arange(3.0).as_subclass(Opaque))
        assert value_digest(opaque) != value_digest(torch.arange(4.0).as_subclass(Opaque))


instantiate_parametrized_tests(TestArrayDigest)


if __name__ == "__main__":
    unittest.main()
