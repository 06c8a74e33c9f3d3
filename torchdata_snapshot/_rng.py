"""Global random state that belongs to an in-process pipeline, not to the training loop.

With workers, DataLoader2 seeds ``random``, ``torch`` and ``numpy`` inside each worker process,
so map functions that use these global RNGs are reproducible. With ``num_workers=0`` the
pipeline shares the main process's global RNGs with the training loop (dropout, weight init,
...): whatever the loop draws between two items changes the data, and a restored run, whose
loop drew differently, cannot replay the same items. Upstream left this as a TODO
("add a method to isolate global RNGs").

:class:`IsolatedRNG` keeps the pipeline's own copy of the three global states: every step of
the pipeline runs inside :meth:`IsolatedRNG.active`, which swaps the pipeline's states in and
the caller's states back out, so neither side sees the other's draws.
"""

from __future__ import annotations

import random
import sys
from array import array
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Tuple

import torch

from torchdata_snapshot._rng_memory import U32, NumpyStateReader, packed_random_state

__all__ = [
    "IsolatedRNG",
    "check_global_rng_state",
    "global_rng_state",
    "pack_python_state",
    "packed_global_rng_state",
    "set_global_rng_state",
    "unpack_global_rng_state",
    "unpack_numpy_state",
    "unpack_python_state",
]


_numpy_reader: Optional[NumpyStateReader] = None  # made when numpy is first seen imported


def _numpy_state() -> Optional[Tuple[Any, ...]]:
    """numpy's global state with its key as bytes (``None``: numpy is not imported)."""
    global _numpy_reader
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    if _numpy_reader is None:
        _numpy_reader = NumpyStateReader(numpy)
    return _numpy_reader.read()


def global_rng_state() -> Tuple[Any, Any, Any]:
    """The states of ``random``, ``torch`` (CPU) and ``numpy`` (if imported) global RNGs."""
    return (random.getstate(), torch.get_rng_state(), unpack_numpy_state(_numpy_state()))


def packed_global_rng_state() -> Tuple[Any, Any, Any]:
    """:func:`global_rng_state` for a checkpoint, read in about 4 us (a capture takes one each
    time): each Mersenne Twister's words, and torch's state, as bytes."""
    python = getattr(random.getstate, "__self__", None)  # the instance random's functions use
    return (
        pack_python_state(random.getstate()) if python is None else packed_random_state(python),
        torch.get_rng_state().numpy().tobytes(),
        _numpy_state(),
    )


def set_global_rng_state(state: Tuple[Any, Any, Any]) -> None:
    """Set the global RNGs to a state taken by :func:`global_rng_state`."""
    python_state, torch_state, numpy_state = state
    random.setstate(python_state)
    torch.set_rng_state(torch_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


def pack_python_state(state: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """A ``random.getstate()`` with its 625 words as bytes: it pickles in about 1 us instead of
    10 (:func:`packed_random_state` reads a generator's state in this form directly)."""
    version, words, gauss = state
    return (version, array(U32, words).tobytes(), gauss)


def unpack_python_state(packed: Any) -> Tuple[Any, ...]:
    """The ``random.getstate()`` of :func:`pack_python_state` (a state that is not packed, as
    older checkpoints hold, is returned as it is)."""
    version, words, gauss = packed
    if isinstance(words, bytes):
        unpacked = array(U32)
        unpacked.frombytes(words)
        words = tuple(unpacked)
    return (version, words, gauss)


def unpack_numpy_state(packed: Optional[Tuple[Any, ...]]) -> Optional[Tuple[Any, ...]]:
    """The ``numpy.random.get_state()`` of a packed one, whose key is bytes (one that is not
    packed, as older checkpoints hold, is returned as it is)."""
    if packed is None or not isinstance(packed[1], bytes):
        return packed
    import numpy  # (the state of a process that had it; unpickling bytes does not import it)

    name, key, *rest = packed
    return (name, numpy.frombuffer(key, dtype=numpy.uint32).copy(), *rest)


def unpack_global_rng_state(packed: Any) -> Tuple[Any, Any, Any]:
    """The :func:`global_rng_state` of :func:`packed_global_rng_state` (or of an older checkpoint,
    which held it unpacked)."""
    python_state, torch_state, numpy_state = packed
    if isinstance(torch_state, bytes):
        torch_state = torch.frombuffer(bytearray(torch_state), dtype=torch.uint8)
    return (unpack_python_state(python_state), torch_state, unpack_numpy_state(numpy_state))


def check_global_rng_state(state: Any) -> None:
    """Raise if ``state`` is not one :func:`global_rng_state` returns (tried on scratch
    generators, so that nothing global changes)."""
    python_state, torch_state, numpy_state = state
    random.Random().setstate(python_state)
    torch.Generator().set_state(torch_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.RandomState().set_state(numpy_state)


class IsolatedRNG:
    """The pipeline's ``random``/``torch``/``numpy`` global states, swapped in around each step."""

    def __init__(self) -> None:
        self._state: Optional[Tuple[Any, Any, Any]] = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the block with the pipeline's global RNG states; the caller's are restored after."""
        callers = global_rng_state()
        if self._state is not None:
            set_global_rng_state(self._state)
        try:
            yield
        finally:
            self._state = global_rng_state()
            set_global_rng_state(callers)
