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

__all__ = [
    "IsolatedRNG",
    "check_global_rng_state",
    "global_rng_state",
    "pack_global_rng_state",
    "pack_python_state",
    "set_global_rng_state",
    "unpack_global_rng_state",
    "unpack_python_state",
]


def global_rng_state() -> Tuple[Any, Any, Any]:
    """The states of ``random``, ``torch`` (CPU) and ``numpy`` (if imported) global RNGs."""
    numpy = sys.modules.get("numpy")
    return (
        random.getstate(),
        torch.get_rng_state(),
        None if numpy is None else numpy.random.get_state(),
    )


def set_global_rng_state(state: Tuple[Any, Any, Any]) -> None:
    """Set the global RNGs to a state taken by :func:`global_rng_state`."""
    python_state, torch_state, numpy_state = state
    random.setstate(python_state)
    torch.set_rng_state(torch_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


#: A 32-bit unsigned array type code: the words of a Mersenne Twister state.
_U32 = "I" if array("I").itemsize == 4 else "L"


def pack_python_state(state: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """A ``random.getstate()`` with its 625 words as bytes: it pickles in about 1 us instead of
    10 (a capture pickles one per Python RNG, at every capture)."""
    version, words, gauss = state
    return (version, array(_U32, words).tobytes(), gauss)


def unpack_python_state(packed: Any) -> Tuple[Any, ...]:
    """The ``random.getstate()`` of :func:`pack_python_state` (a state that is not packed, as
    older checkpoints hold, is returned as it is)."""
    version, words, gauss = packed
    if isinstance(words, bytes):
        unpacked = array(_U32)
        unpacked.frombytes(words)
        words = tuple(unpacked)
    return (version, words, gauss)


def pack_global_rng_state(state: Tuple[Any, Any, Any]) -> Tuple[Any, Any, Any]:
    """A :func:`global_rng_state` for a checkpoint: Python's words and torch's state as bytes
    (pickling the tensor alone took 25 us of a capture's ~110)."""
    python_state, torch_state, numpy_state = state
    return (pack_python_state(python_state), torch_state.numpy().tobytes(), numpy_state)


def unpack_global_rng_state(packed: Any) -> Tuple[Any, Any, Any]:
    """The :func:`global_rng_state` of :func:`pack_global_rng_state` (or of an older checkpoint,
    which held it unpacked)."""
    python_state, torch_state, numpy_state = packed
    if isinstance(torch_state, bytes):
        torch_state = torch.frombuffer(bytearray(torch_state), dtype=torch.uint8)
    return (unpack_python_state(python_state), torch_state, numpy_state)


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
