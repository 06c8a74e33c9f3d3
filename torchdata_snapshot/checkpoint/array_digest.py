"""How a tensor or an array counts in a digest: by its values, never its memory as such.

Tensors and arrays contribute a tag (their kind, dtype and shape) and their *values*: the bytes of
their elements in C order, at most ``SAMPLE_BYTES`` from each end, as two CRC-32s (of the first and
the second half of what is read: its two ends, or its halves when it is read whole), a tenth of
what hashing them costs. So strides do not count (0 from
``expand`` or ``broadcast_to``, negative, Fortran order, channels_last, a 1-element tensor's
arbitrary one), nor do a tensor's conjugate and negative bits (applied), its device or its
subclass (``nn.Parameter``). A quantized tensor contributes its integers and quantization
parameters; a sparse one its indices and values (COO coalesced first, compressed layouts their
compressed and plain indices); a nested one its components; an object array its first 64 objects.
The padding of a numpy element, which holds whatever the memory held and so differs between
processes, reads as zeros: the bytes of a structured dtype that no field covers (read field by
field: nested structures and subarray fields too) and those of a long double beyond its
significant width (6 of x87's 16 bytes, as ``numpy.finfo`` tells; binary128 has none). A
contiguous CPU tensor, and a C-contiguous array without padding, is read in place; anything else
is copied only where it is sampled. A tensor or array that cannot be read (a dtype without
kernels, a subclass that refuses) contributes its type and shape: a divergence in its values goes
unnoticed, but no item that pickles makes the digest fail.

torch and numpy are never imported here: a value is a tensor or an array only if its module is
already loaded.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import sys
import zlib
from typing import Any, Callable, List, Optional, Tuple

__all__ = [
    "SAMPLE_BYTES",
    "feed_ndarray",
    "feed_tensor",
    "is_ndarray",
    "is_numpy_scalar",
    "is_tensor",
    "tensor_hash",
    "value_digest",
]

#: Bytes of a tensor's or array's data hashed from each end.
SAMPLE_BYTES = 4096

#: A strided tensor up to this size is copied whole to be sampled, a larger one only at its ends.
_COPIED_WHOLE_BYTES = 64 * 1024

#: The integer dtype of each element size, by name (torch is imported only when an item has a tensor).
_SAME_SIZE_INTEGERS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}

#: Components of a nested tensor digested from each end.
_NESTED_COMPONENTS = 32


def value_digest(value: Any) -> str:
    """A 16-hex-digit digest of a tensor's or a (non-object) array's values: what
    ``item_digest`` gives for it as an item of its own."""
    h = hashlib.blake2b(digest_size=8)
    if is_tensor(value):
        feed_tensor(h, value)
    elif is_ndarray(value) and not value.dtype.hasobject:
        feed_ndarray(h, value, _refuse_object)
    else:
        raise TypeError(f"value_digest takes a tensor or an array of values, not {type(value).__qualname__}")
    return h.hexdigest()


def _refuse_object(h: Any, x: Any) -> None:
    raise AssertionError("unreachable: value_digest refuses object arrays")


def is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_numpy_scalar(obj: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.generic)


def is_ndarray(obj: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


def _sample(h: Any, data: Any) -> None:
    """Feed ``h`` what the values ``data`` (bytes in C order) contribute (see :func:`_sampled`)."""
    for code in _sampled(data):
        h.update(code)


def _sampled(data: Any) -> List[Any]:
    """What the values ``data`` (their bytes in C order) contribute, as a list: the CRC-32s of its
    first and last ``SAMPLE_BYTES`` (its halves, when it has no more than twice that). A CRC-32
    changes with any change of up to 32 consecutive bits and misses others with a chance of
    2**-32; blake2b, which fed them before, cost ten times as much (see the docs' performance
    page)."""
    n = len(data)
    if n == 0:
        return []
    if n <= 2 * SAMPLE_BYTES:
        return [_crcs(data[: n // 2], data[n // 2 :])]
    return [_crcs(data[:SAMPLE_BYTES], data[-SAMPLE_BYTES:])]


def _crcs(head: Any, tail: Any) -> bytes:
    return _TWO_CRCS(zlib.crc32(head), zlib.crc32(tail))


_TWO_CRCS = struct.Struct("<II").pack


def _ends(count: int, itemsize: int) -> Optional[int]:
    """How many elements from each end hold the bytes ``_sample`` reads of ``count`` elements of
    ``itemsize`` bytes, or ``None`` when it reads them all."""
    if count * itemsize <= 2 * SAMPLE_BYTES:
        return None
    return -(-SAMPLE_BYTES // itemsize)


def _unreadable(obj: Any) -> bytes:
    """What a tensor or array we cannot read contributes: its type and, if it has a plain one,
    its shape (a divergence in its values goes unnoticed; an item that pickles never fails)."""
    try:
        shape = b"" if getattr(obj, "is_nested", False) else str(tuple(obj.shape)).encode()
    except Exception:
        shape = b""
    return b"?" + type(obj).__qualname__.encode() + shape


# --- tensors ----------------------------------------------------------------------------------


def tensor_hash(t: Any) -> Optional[int]:
    """``int(item_digest(t), 16)`` for a plain tensor, the common item (exactly ``torch.Tensor``,
    contiguous, on the CPU, without autograd, conjugate or negative bits, of a dtype numpy has),
    at the cost of hashing its tag and the CRC-32s of its values once (see :func:`_sampled`);
    ``None`` for any other tensor.

    It calls no tensor method but ``numpy()`` (which refuses conjugate and negative bits, autograd,
    other layouts and dtypes numpy lacks): each method releases the GIL, and in a worker the
    thread that sends items takes it then, for as long as it runs."""
    # (Inlined: it runs for every item of a stream of tensors. torch is imported: t is a tensor.)
    if not (type(t) is sys.modules["torch"].Tensor and t.is_cpu and not (t.requires_grad or t.is_nested)):
        return None
    try:
        array = t.numpy()
    except (TypeError, RuntimeError):  # see above: item_digest reads those
        return None
    if not array.flags.c_contiguous:
        return None
    data = _tensor_tag(t.dtype, t.shape)
    if array.size:
        data += b"".join(_sampled(memoryview(array).cast("B")))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def feed_tensor(h: Any, t: Any) -> None:
    """Feed ``t``'s tag (kind, dtype, shape) and values to the hash ``h``."""
    import torch

    if (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.is_cpu
        and not (t.is_nested or t.is_quantized or t.requires_grad or t.is_conj() or t.is_neg())
        and t.is_contiguous()
    ):
        try:  # the common case, read in place through numpy (5 us less than the general path)
            array: Any = t.numpy()
        except TypeError:  # a dtype numpy lacks (bfloat16, float8, complex32)
            pass
        else:
            h.update(_tensor_tag(t.dtype, t.shape))
            if array.size:
                _sample(h, memoryview(array).cast("B"))
            return
    try:
        chunks = _tensor_chunks(t)
    except Exception:  # an exotic tensor (a dtype without kernels, a subclass that refuses)
        chunks = [b"t" + _unreadable(t)]
    for chunk in chunks:
        h.update(chunk)


@functools.lru_cache(maxsize=1024)
def _tensor_tag(dtype: Any, shape: Any) -> bytes:
    """A tensor's tag: its kind, dtype and shape (the same few, item after item: kept)."""
    return b"t" + str(dtype).encode() + str(tuple(shape)).encode()


def _tensor_chunks(t: Any) -> List[Any]:
    """What any tensor contributes: its tag, then its values as ``_strided_values`` reads them
    (a quantized tensor's integers and parameters, a sparse one's indices and values, a nested
    one's components), never its storage as such."""
    import torch

    if t.is_nested:
        return _nested_chunks(t)
    chunks: List[Any] = [b"t" + str(t.dtype).encode() + str(tuple(t.shape)).encode()]
    if t.device.type == "meta":  # no data
        return chunks
    t = t.detach()
    layout = t.layout
    if t.is_quantized:
        chunks.append(_quantization(t))
        chunks += _strided_values(t.int_repr())
    elif layout == torch.strided:
        chunks += _strided_values(t)
    elif layout == torch.sparse_coo:
        t = t.coalesce()  # sorted indices, duplicates summed: one form per value
        chunks.append(b"coo" + struct.pack("<qq", t.sparse_dim(), t.dense_dim()))
        chunks += _tensor_chunks(t.indices()) + _tensor_chunks(t.values())
    elif str(layout) in _COMPRESSED_INDICES:
        compressed, plain = _COMPRESSED_INDICES[str(layout)]
        chunks.append(str(layout).encode())
        for part in (getattr(t, compressed)(), getattr(t, plain)(), t.values()):
            chunks += _tensor_chunks(part)
    else:  # another layout (mkldnn): its values, through a dense copy
        chunks += _strided_values(t.to_dense())
    return chunks


#: The accessors of a compressed sparse layout's indices: compressed, then plain.
_COMPRESSED_INDICES = {
    "torch.sparse_csr": ("crow_indices", "col_indices"),
    "torch.sparse_bsr": ("crow_indices", "col_indices"),
    "torch.sparse_csc": ("ccol_indices", "row_indices"),
    "torch.sparse_bsc": ("ccol_indices", "row_indices"),
}


def _quantization(t: Any) -> bytes:
    import torch

    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return str(scheme).encode() + struct.pack("<dq", t.q_scale(), t.q_zero_point())
    parameters = hashlib.blake2b(digest_size=8)  # as the digest of the item [scales, zero points]
    parameters.update(b"L" + struct.pack("<q", 2))
    feed_tensor(parameters, t.q_per_channel_scales())
    feed_tensor(parameters, t.q_per_channel_zero_points())
    axis = struct.pack("<q", t.q_per_channel_axis())
    return str(scheme).encode() + axis + parameters.hexdigest().encode()


def _nested_chunks(t: Any) -> List[Any]:
    """A nested tensor: its components, at most ``_NESTED_COMPONENTS`` from each end (its shape
    names a jagged dimension by a number that depends on the process)."""
    components = t.detach().unbind()
    count = len(components)
    chunks: List[Any] = [b"n" + str(t.dtype).encode() + str(t.layout).encode() + struct.pack("<q", count)]
    if count > 2 * _NESTED_COMPONENTS:
        components = components[:_NESTED_COMPONENTS] + components[-_NESTED_COMPONENTS:]
    for component in components:
        chunks += _tensor_chunks(component)
    return chunks


def _strided_values(t: Any) -> List[Any]:
    """The bytes ``_sample`` takes of a strided tensor's values in C order. A contiguous CPU
    tensor is read in place, whatever its dtype (a 1-element one whatever its stride); any other
    (strides of 0 from ``expand``, a transpose, channels_last, another device, conjugate or
    negative bits, which ``clone`` and ``copy_`` apply) is copied: whole when small (one copy
    costs less than two), else only where it is sampled."""
    import torch

    count = t.numel()
    if count == 0:
        return []
    size = t.element_size()
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        data = t.as_strided((count,), (1,)).view(torch.uint8).numpy()
    else:
        if size in _SAME_SIZE_INTEGERS and not (t.is_conj() or t.is_neg()):
            # Copied as integers of its size: the same bytes, and no kernel (nor its warnings,
            # "ComplexHalf support is experimental") of an exotic dtype needed.
            t = t.view(getattr(torch, _SAME_SIZE_INTEGERS[size]))
        k = _ends(count, size)
        if k is None or count * size <= _COPIED_WHOLE_BYTES:
            data = _tensor_bytes(t, [(0, count)])
        else:
            data = _tensor_bytes(t, [(0, k), (count - k, count)])
    return _sampled(data)


def _tensor_bytes(t: Any, ranges: List[Tuple[int, int]]) -> Any:
    """The elements of ``t`` in each ``(start, stop)`` range (in C order), one range after the
    other, copied into a new tensor (on the CPU), as a numpy array of its bytes."""
    import torch

    if ranges == [(0, t.numel())]:  # whole: standard strides, whatever t's, and the bits applied
        out = t.clone(memory_format=torch.contiguous_format)
    else:
        out = torch.empty(sum(stop - start for start, stop in ranges), dtype=t.dtype, device=t.device)
        offset = 0
        for start, stop in ranges:
            for part in _c_order_parts(t, start, stop):
                size = part.numel()
                out[offset : offset + size].view(part.shape).copy_(part)
                offset += size
    return out.cpu().reshape(-1).view(torch.uint8).numpy()


def _c_order_parts(t: Any, start: int, stop: int) -> List[Any]:
    """Views of ``t`` whose elements, one view after the other in C order, are ``t``'s elements
    ``start..stop-1`` in C order: at most two per dimension."""
    if start == 0 and stop == t.numel():
        return [t]
    row = t.numel() // t.shape[0]  # t has a dimension: a 0-d tensor has one element, taken whole
    first, first_offset = divmod(start, row)
    last, last_offset = divmod(stop, row)
    if first == last:
        return _c_order_parts(t[first], first_offset, last_offset)
    parts = []
    if first_offset:
        parts += _c_order_parts(t[first], first_offset, row)
        first += 1
    if last > first:
        parts.append(t[first:last])
    if last_offset:
        parts += _c_order_parts(t[last], 0, last_offset)
    return parts


# --- numpy arrays -----------------------------------------------------------------------------


def feed_ndarray(h: Any, a: Any, feed_object: Callable[[Any, Any], None]) -> None:
    """Feed ``a``'s tag and values to ``h``; ``feed_object(h, x)`` feeds an element of an object array."""
    h.update(b"a" + str(a.dtype).encode() + str(a.shape).encode())
    dtype = a.dtype
    if dtype.hasobject:
        for x in a.reshape(-1)[:64]:
            feed_object(h, x)
        return
    try:
        if dtype.char not in "gGV" and a.flags.c_contiguous:
            # The common case: every byte is the value (no long double, no structure), in place.
            import numpy

            _sample(h, numpy.ascontiguousarray(a).reshape(-1).view(numpy.uint8).data)
            return
        chunks = _array_chunks(a)
    except Exception:  # an exotic dtype or subclass
        chunks = [_unreadable(a)]
    for chunk in chunks:
        h.update(chunk)


def _array_chunks(a: Any) -> List[Any]:
    """The bytes ``_sample`` takes of an array's values in C order, its padding zeroed (see
    ``_padding_mask``): read in place when it is C-contiguous without padding, else copied only
    where it is sampled (a slice of ``flat`` follows any strides: negative, 0, Fortran order)."""
    import numpy

    a = numpy.asarray(a)  # a subclass (a masked array): its data
    count, itemsize = a.size, a.dtype.itemsize
    if count == 0 or itemsize == 0:
        return []
    mask = _padding_mask(a.dtype)
    if mask is None and a.flags.c_contiguous:
        return _sampled(a.reshape(-1).view(numpy.uint8))
    k = _ends(count, itemsize)
    if k is None:
        return _sampled(_value_bytes(a.flatten(), mask))
    head, tail = _value_bytes(a.flat[:k], mask), _value_bytes(a.flat[count - k :], mask)
    return [_crcs(head[:SAMPLE_BYTES], tail[-SAMPLE_BYTES:])]


def _value_bytes(elements: Any, mask: Any) -> Any:
    """A new 1-d C-contiguous array's bytes, its padding bytes zeroed."""
    import numpy

    data = elements.view(numpy.uint8)
    if mask is not None:
        data = (data.reshape(-1, mask.size) & mask).reshape(-1)
    return data


@functools.lru_cache(maxsize=256)
def _padding_mask(dtype: Any) -> Any:
    """``None`` when every byte of a ``dtype`` element is part of its value; else, per byte of an
    element, ``0xFF`` for a byte of its value and ``0`` for padding (the bytes between aligned
    fields of a structured dtype, or not covered by any field; those of a long double beyond its
    significant width), whose content is whatever the memory held, different in each process."""
    import numpy

    value = bytearray(dtype.itemsize)
    _mark_value_bytes(value, dtype, 0)
    if all(value):
        return None
    return numpy.frombuffer(bytes(value), numpy.uint8)


def _mark_value_bytes(value: bytearray, dtype: Any, offset: int) -> None:
    """Set ``value``'s bytes that hold the value of a ``dtype`` element starting at ``offset``."""
    if dtype.names is not None:  # field by field (fields may overlap; padding stays unmarked)
        for name in dtype.names:
            field, field_offset = dtype.fields[name][:2]
            _mark_value_bytes(value, field, offset + field_offset)
    elif dtype.subdtype is not None:  # a subarray field: its base dtype, repeated
        base, shape = dtype.subdtype
        count = math.prod(shape)
        if _padding_mask(base) is None:
            value[offset : offset + count * base.itemsize] = b"\xff" * (count * base.itemsize)
        else:
            for i in range(count):
                _mark_value_bytes(value, base, offset + i * base.itemsize)
    elif dtype.char in "gG":  # long double, complex long double (two of them)
        width = _long_double_width()
        half = dtype.itemsize // 2 if dtype.char == "G" else dtype.itemsize
        little = dtype.byteorder == "<" or (dtype.byteorder in "=|" and sys.byteorder == "little")
        for start in range(offset, offset + dtype.itemsize, half):
            first = start if little else start + half - width  # the low-order bytes
            value[first : first + width] = b"\xff" * width
    else:
        value[offset : offset + dtype.itemsize] = b"\xff" * dtype.itemsize


@functools.cache
def _long_double_width() -> int:
    """How many bytes of a ``numpy.longdouble`` hold its value on this platform, as ``numpy.finfo``
    tells: x87's 80-bit extended precision (63 fraction bits, an explicit integer bit and 15
    exponent bits) fills 10 of its 12 or 16 bytes; binary64, binary128 and IBM's double-double
    (two float64s; a formula from ``nmant`` and ``nexp`` would undercount it) fill all of them."""
    import numpy

    info = numpy.finfo(numpy.longdouble)
    size = numpy.dtype(numpy.longdouble).itemsize
    return min(10, size) if (info.nmant, info.nexp) == (63, 15) else size
