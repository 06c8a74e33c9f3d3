"""``item_digest``: a short, content-based fingerprint of an item, to detect replay divergence.

Deterministic replay is only exact for deterministic pipelines. The checkpoint records the
digest of the last item each worker delivered; a restored worker recomputes it on the item it
replays at that position and refuses to continue if they differ.

The digest must be equal for equal items in *different processes* (so no ``id()``, no
``hash()`` of strings, which is salted per process, and no pickle of a shared-memory tensor,
which names a file descriptor) and cheap for large items: tensors and arrays contribute their
type, shape and at most ``SAMPLE_BYTES`` from each end of their data. Objects of unknown types
contribute their ``__dict__`` (or only their type name), so a false alarm is impossible (as long
as a DataPipe does not change an item after yielding it: the outbox thread digests it while the
worker produces the next) and a missed divergence possible only for exotic items.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import Any, Callable, Dict

__all__ = ["SAMPLE_BYTES", "item_digest"]

#: Bytes of a tensor's or array's data hashed from each end.
SAMPLE_BYTES = 4096

_MAX_DEPTH = 32


def item_digest(item: Any) -> str:
    """A 16-hex-digit digest of ``item``'s content, stable across processes."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, item, 0)
    return h.hexdigest()


def _feed(h: Any, obj: Any, depth: int) -> None:
    feeder = _FEEDERS.get(type(obj))
    if feeder is not None:
        feeder(h, obj, depth)
        return
    if depth >= _MAX_DEPTH:
        h.update(b"?")
        return
    if isinstance(obj, (tuple, list)):  # namedtuples and list subclasses
        _feed_sequence(h, obj, depth)
    elif isinstance(obj, dict):
        _feed_dict(h, obj, depth)
    elif _is_tensor(obj):
        _feed_tensor(h, obj)
    elif _is_ndarray(obj):
        _feed_ndarray(h, obj)
    else:
        h.update(b"O" + type(obj).__qualname__.encode())
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            _feed_dict(h, state, depth)


def _feed_int(h: Any, obj: int, depth: int) -> None:
    h.update(b"i" + str(obj).encode())


def _feed_float(h: Any, obj: float, depth: int) -> None:
    h.update(b"f" + struct.pack("<d", obj))


def _feed_str(h: Any, obj: str, depth: int) -> None:
    data = obj.encode("utf-8", "surrogatepass")
    h.update(b"s" + struct.pack("<q", len(data)) + data)


def _feed_bytes(h: Any, obj: Any, depth: int) -> None:
    h.update(b"b" + struct.pack("<q", len(obj)))
    h.update(obj)


def _feed_none(h: Any, obj: None, depth: int) -> None:
    h.update(b"N")


def _feed_bool(h: Any, obj: bool, depth: int) -> None:
    h.update(b"T" if obj else b"F")


def _feed_sequence(h: Any, obj: Any, depth: int) -> None:
    h.update(b"L" + struct.pack("<q", len(obj)))
    for x in obj:
        _feed(h, x, depth + 1)


def _feed_dict(h: Any, obj: Dict[Any, Any], depth: int) -> None:
    h.update(b"D" + struct.pack("<q", len(obj)))
    for k, v in obj.items():
        _feed(h, k, depth + 1)
        _feed(h, v, depth + 1)


def _feed_set(h: Any, obj: Any, depth: int) -> None:
    # Iteration order of a set depends on the per-process string hash salt: sort the digests.
    h.update(b"S" + struct.pack("<q", len(obj)))
    for d in sorted(item_digest(x) for x in obj):
        h.update(d.encode())


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_ndarray(obj: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


def _sample(h: Any, data: memoryview) -> None:
    if len(data) <= 2 * SAMPLE_BYTES:
        h.update(data)
    else:
        h.update(data[:SAMPLE_BYTES])
        h.update(data[-SAMPLE_BYTES:])


def _feed_tensor(h: Any, t: Any) -> None:
    import torch

    h.update(b"t" + str(t.dtype).encode() + str(tuple(t.shape)).encode())
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)  # lazy views have no raw bytes
    if flat.numel() == 0:
        return
    if flat.device.type != "cpu":
        flat = flat.cpu()
    per_end = max(1, SAMPLE_BYTES // max(1, flat.element_size()))
    parts = [flat] if flat.numel() <= 2 * per_end else [flat[:per_end], flat[-per_end:]]
    for part in parts:
        part = part.contiguous()
        if part.dtype == torch.bool:
            part = part.to(torch.uint8)
        h.update(part.view(torch.uint8).numpy().tobytes())


def _feed_ndarray(h: Any, a: Any) -> None:
    h.update(b"a" + str(a.dtype).encode() + str(a.shape).encode())
    if a.dtype.hasobject:
        for x in a.reshape(-1)[:64]:
            _feed(h, x, _MAX_DEPTH - 1)
        return
    import numpy

    _sample(h, numpy.ascontiguousarray(a).reshape(-1).view(numpy.uint8).data)


_FEEDERS: Dict[type, Callable[[Any, Any, int], None]] = {
    int: _feed_int,
    float: _feed_float,
    str: _feed_str,
    bytes: _feed_bytes,
    bytearray: _feed_bytes,
    type(None): _feed_none,
    bool: _feed_bool,
    tuple: _feed_sequence,
    list: _feed_sequence,
    dict: _feed_dict,
    set: _feed_set,
    frozenset: _feed_set,
}
