"""Mersenne Twister states read from memory, in about a microsecond instead of 10 to 25.

A worker's state capture holds several twister states: the ``random`` and numpy global RNGs and
a shuffler's own ``random.Random``. Their APIs build hundreds of Python objects for each: about
half of a 90 us capture of a shuffled, batched pipeline, at every capture, whether anything drew
or not (numpy's ``get_state()`` alone copies its 624 words one at a time, 23 us). Captures that
cost less are taken more often, and a restore replays less (see :mod:`torchdata_snapshot._capture`).

- :func:`packed_random_state`: a C ``_random.Random`` keeps its ``index`` and then its 624 words
  in the object. Where is found once, by setting a known state on a scratch generator and
  finding it in the object's memory.
- :class:`NumpyStateReader`: numpy publishes the address of its bit generators' state
  (``MT19937.ctypes.state_address``: ``{uint32 key[624]; int pos;}``); the legacy Gaussian
  cache (``has_gauss``, ``gauss``) is in the ``RandomState`` object, found once by setting known
  values on a scratch one and looking where they land.

Each reader is checked against the API on scratch generators after draws before it is trusted;
a layout that is not recognised falls back on the API, slower and never different. (A read does
not take numpy's lock: a draw in another thread at the same moment, which a capture between two
items cannot order anyway, could be seen half-done.)
"""

from __future__ import annotations

import ctypes
import random
import struct
from array import array
from typing import Any, Optional, Tuple

__all__ = ["NumpyStateReader", "U32", "packed_random_state"]

#: A 32-bit unsigned array type code: the words of a Mersenne Twister state.
U32 = "I" if array("I").itemsize == 4 else "L"
_WORDS = 624
_TWISTER_BYTES = 4 * _WORDS + 4  # key[624] and pos (numpy), index and key[624] (Python)


def packed_random_state(rng: random.Random) -> Tuple[Any, bytes, Any]:
    """``rng.getstate()`` with its 624 words and index as the bytes of a 625-word array."""
    if _INDEX_AT is None or type(rng).getstate is not random.Random.getstate:
        version, words, gauss = rng.getstate()
        return (version, array(U32, words).tobytes(), gauss)
    raw = ctypes.string_at(id(rng) + _INDEX_AT, _TWISTER_BYTES)  # index, then the words
    return (rng.VERSION, raw[4:] + raw[:4], rng.gauss_next)  # type: ignore[attr-defined]


def _index_offset() -> Optional[int]:
    """Where a ``random.Random`` keeps its index and words (``None``: not recognised)."""
    try:
        scratch = random.Random()
        scratch.setstate((scratch.VERSION, tuple(range(7, 7 + _WORDS)) + (_WORDS - 5,), None))
        words = scratch.getstate()[1]
        pattern = array(U32, words[-1:] + words[:-1]).tobytes()
        memory = ctypes.string_at(id(scratch), type(scratch).__basicsize__)
        at = memory.find(pattern)
        if at < 0 or memory.find(pattern, at + 1) >= 0:
            return None
        for draws in (1, 700, 3):  # (700: past the end of the words, which are then regenerated)
            for _ in range(draws):
                scratch.random()
            raw = ctypes.string_at(id(scratch) + at, _TWISTER_BYTES)
            version, words, _ = scratch.getstate()
            if raw[4:] + raw[:4] != array(U32, words).tobytes():
                return None
        return at
    except Exception:  # an unexpected Python: getstate() it is
        return None


_INDEX_AT = _index_offset()
# (has_gauss, gauss) values set on a scratch RandomState to find where they are kept.
_PROBES = ((1, 0.8133425913027116), (0, -2.5e-300), (1, 12345.678), (0, 7.25))


class NumpyStateReader:
    """``numpy.random.get_state()`` of the global ``RandomState``, read from memory."""

    def __init__(self, numpy: Any) -> None:
        self._numpy = numpy
        self._mt19937 = numpy.random.MT19937
        self._gauss_fields = _gauss_fields(numpy)  # (has_gauss offset, gauss offset) or None
        self._bit_generator: Any = None
        self._address = 0

    @property
    def fast(self) -> bool:
        """Whether reads come from memory (``False``: from ``get_state()``)."""
        return self._gauss_fields is not None

    def read(self) -> Tuple[Any, ...]:
        """``('MT19937', key, pos, has_gauss, gauss)`` as ``numpy.random.get_state()`` returns
        it, except that ``key`` is the bytes of its array."""
        state = self._numpy.random.mtrand._rand
        bit_generator = state._bit_generator
        if self._gauss_fields is not None and type(bit_generator) is self._mt19937:
            if bit_generator is not self._bit_generator:  # (held: its address stays valid)
                self._bit_generator, self._address = bit_generator, bit_generator.ctypes.state_address
            return _read_state(state, self._address, self._gauss_fields)
        name, key, *rest = state.get_state()
        return (name, key.tobytes(), *rest)


def _read_state(state: Any, address: int, fields: Tuple[int, int]) -> Tuple[Any, ...]:
    twister = ctypes.string_at(address, _TWISTER_BYTES)
    has_gauss_at, gauss_at = fields
    (has_gauss,) = struct.unpack("i", ctypes.string_at(id(state) + has_gauss_at, 4))
    (gauss,) = struct.unpack("d", ctypes.string_at(id(state) + gauss_at, 8))
    (pos,) = struct.unpack_from("i", twister, 4 * _WORDS)
    return ("MT19937", twister[: 4 * _WORDS], pos, has_gauss, gauss)


def _gauss_fields(numpy: Any) -> Optional[Tuple[int, int]]:
    """The offsets of ``has_gauss`` (a C int) and ``gauss`` (a C double) in a ``RandomState``,
    or ``None`` if they cannot be told for sure."""
    try:
        scratch = numpy.random.RandomState(0)
        key = scratch.get_state()[1]
        size = type(scratch).__basicsize__
        ints, doubles = set(range(0, size - 3, 4)), set(range(0, size - 7, 8))
        for has_gauss, gauss in _PROBES:
            scratch.set_state(("MT19937", key, 624, has_gauss, gauss))
            memory = ctypes.string_at(id(scratch), size)
            ints = {at for at in ints if struct.unpack_from("i", memory, at)[0] == has_gauss}
            doubles = {at for at in doubles if struct.unpack_from("d", memory, at)[0] == gauss}
        if len(ints) != 1 or len(doubles) != 1:
            return None
        fields = (ints.pop(), doubles.pop())
        address = scratch._bit_generator.ctypes.state_address
        for _ in range(3):  # drawn states (a cached Gaussian, another key) read as get_state says
            scratch.standard_normal(7)
            name, key, *rest = scratch.get_state()
            if _read_state(scratch, address, fields) != (name, key.tobytes(), *rest):
                return None
        return fields
    except Exception:  # an unexpected numpy: get_state() it is
        return None
