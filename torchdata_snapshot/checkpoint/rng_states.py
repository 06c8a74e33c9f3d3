"""Global random state that belongs to an in-process pipeline, not to the training loop.

With workers, DataLoader2 seeds ``random``, ``torch`` and ``numpy`` inside each worker process,
so map functions that use these global RNGs are reproducible. With ``num_workers=0`` the
pipeline shares the main process's global RNGs with the training loop (dropout, weight init,
...): whatever the loop draws between two items changes the data, and a restored run, whose
loop drew differently, cannot replay the same items. DataLoader2 left this as a TODO
("add a method to isolate global RNGs").

:class:`IsolatedRNG` keeps the pipeline's own copy of the three global states: every step of
the pipeline runs between :meth:`IsolatedRNG.swap_in` and :meth:`IsolatedRNG.swap_out` (or
inside :meth:`IsolatedRNG.active`, which calls both), which swap the pipeline's states in and
the caller's states back out, so neither side sees the other's draws. It uses public APIs
only, and swaps numpy's state by reference (its global ``RandomState``'s bit generator), which
clears numpy's legacy Gaussian cache: see :class:`IsolatedRNG`.

The other functions read and set the global states for a worker's captures
(:mod:`torchdata_snapshot.graph_state.graph_state`).
"""

from __future__ import annotations

import random
import struct
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Tuple

import torch
from torchdata.dataloader2.random import SeedGenerator

__all__ = [
    "IsolatedRNG",
    "check_global_rng_state",
    "pack_python_state",
    "packed_global_rng_state",
    "seed_global_rngs",
    "set_global_rng_state",
    "unpack_global_rng_state",
    "unpack_numpy_state",
    "unpack_python_state",
]


#: A Mersenne Twister's words in a checkpoint: little-endian 32-bit, whatever the machine, so
#: that a checkpoint moves between byte orders.
_WORDS = "<{}I"


#: torch's global CPU generator (what ``torch.get_rng_state()`` reads, without the call around it).
_TORCH = torch.default_generator


def _pack_words(words: Any) -> bytes:
    return struct.pack(_WORDS.format(len(words)), *words)


def _unpack_words(packed: bytes) -> Tuple[int, ...]:
    return struct.unpack(_WORDS.format(len(packed) // 4), packed)


def _numpy_state() -> Optional[Tuple[Any, ...]]:
    """numpy's global state (``numpy.random.get_state()``) with its key as bytes (``None``:
    ``numpy.random`` is not imported, so nothing drew from it)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is None:
        return None
    name, key, *rest = numpy_random.get_state()
    return (name, key.astype("<u4").tobytes(), *rest)


def packed_global_rng_state() -> Tuple[Any, Any, Any]:
    """The states of the ``random``, ``torch`` (CPU) and ``numpy`` (if imported) global RNGs for
    a checkpoint, read through their public APIs: each Mersenne Twister's words, and torch's
    state, as bytes, which pickle in a fraction of the time their tuples of ints take
    (:func:`unpack_global_rng_state` unpacks them)."""
    return (pack_python_state(random.getstate()), torch.get_rng_state().numpy().tobytes(), _numpy_state())


def seed_global_rngs(seed_generator: SeedGenerator) -> None:
    """Seed the ``random``, ``torch`` and (where it is installed) ``numpy`` global RNGs with the
    next three seeds ``seed_generator`` draws for this process, as a worker's are seeded at the
    start of its epoch (numpy takes 32 bits)."""
    random.seed(seed_generator.generate_seed())
    torch.manual_seed(seed_generator.generate_seed())
    numpy_seed = seed_generator.generate_seed() >> 32
    try:
        import numpy.random
    except ImportError:
        return
    numpy.random.seed(numpy_seed)


def set_global_rng_state(state: Tuple[Any, Any, Any]) -> None:
    """Set the global RNGs to an unpacked state (see :func:`unpack_global_rng_state`)."""
    python_state, torch_state, numpy_state = state
    random.setstate(python_state)
    torch.set_rng_state(torch_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


def pack_python_state(state: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """A ``random.getstate()`` (of the module or of a ``random.Random``) with its 625 words as
    little-endian bytes."""
    version, words, gauss = state
    return (version, _pack_words(words), gauss)


def unpack_python_state(packed: Any) -> Tuple[Any, ...]:
    """The ``random.getstate()`` of :func:`pack_python_state` (a state that is not packed, as
    older checkpoints hold, is returned as it is)."""
    version, words, gauss = packed
    if isinstance(words, bytes):
        words = _unpack_words(words)
    return (version, words, gauss)


def unpack_numpy_state(packed: Optional[Tuple[Any, ...]]) -> Optional[Tuple[Any, ...]]:
    """The ``numpy.random.get_state()`` of a packed one, whose key is bytes (one that is not
    packed, as older checkpoints hold, is returned as it is)."""
    if packed is None or not isinstance(packed[1], bytes):
        return packed
    import numpy  # (the state of a process that had it; unpickling bytes does not import it)

    name, key, *rest = packed
    return (name, numpy.frombuffer(key, dtype="<u4").astype(numpy.uint32), *rest)


def unpack_global_rng_state(packed: Any) -> Tuple[Any, Any, Any]:
    """``(random.getstate(), torch.get_rng_state(), numpy.random.get_state() or None)`` from
    :func:`packed_global_rng_state` (or from an older checkpoint, which held it unpacked)."""
    python_state, torch_state, numpy_state = packed
    if isinstance(torch_state, bytes):
        torch_state = torch.frombuffer(bytearray(torch_state), dtype=torch.uint8)
    return (unpack_python_state(python_state), torch_state, unpack_numpy_state(numpy_state))


def check_global_rng_state(state: Any) -> None:
    """Raise if ``state`` is not one :func:`unpack_global_rng_state` returns (tried on scratch
    generators, so that nothing global changes)."""
    python_state, torch_state, numpy_state = state
    random.Random().setstate(python_state)
    torch.Generator().set_state(torch_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.RandomState().set_state(numpy_state)


def _numpy_now(numpy_random: Any) -> Any:
    """numpy's global random state as :func:`_swap_numpy` swaps it."""
    if hasattr(numpy_random, "set_bit_generator"):
        return numpy_random.get_bit_generator()
    return numpy_random.get_state()


def _swap_numpy(numpy_random: Any, incoming: Any) -> Any:
    """Install ``incoming`` as numpy's global random state (``None``: a copy of the current one)
    and return the state it replaces; either way the legacy Gaussian cache is cleared.

    The state is the global ``RandomState``'s bit generator, swapped by reference with
    ``set_bit_generator`` (numpy >= 1.25, under a microsecond; it clears the cache), or else the
    tuple of ``get_state()``, set with the cache cleared (about 80 us), so that the data do not
    depend on the numpy version.
    """
    set_bit_generator = getattr(numpy_random, "set_bit_generator", None)
    if set_bit_generator is None:
        outgoing = numpy_random.get_state()
        name, key, pos, _, _ = outgoing if incoming is None else incoming
        numpy_random.set_state((name, key, pos, 0, 0.0))
        return outgoing
    outgoing = numpy_random.get_bit_generator()
    if incoming is None:
        incoming = type(outgoing)()
        incoming.state = outgoing.state
    set_bit_generator(incoming)
    return outgoing


class IsolatedRNG:
    """The pipeline's ``random``/``torch``/``numpy`` global states, swapped in around each step.

    A swap (:meth:`swap_in`, then :meth:`swap_out`) takes two ``random.getstate()``/``setstate()``,
    two reads and sets of torch's CPU generator's state and two
    ``numpy.random.set_bit_generator()``: about 25 us, of which ``random.getstate()`` (625 Python
    ints built) is two thirds. That is the price of public APIs: nothing cheaper reads or sets
    ``random``'s state.

    numpy's legacy Gaussian cache (the second value of a pair ``numpy.random.normal`` and its
    kin draw) does not survive a swap: it is cleared at every swap, and by :meth:`next_item`
    between two items produced in one swap, so that each item starts with it empty however
    items are grouped into swaps. (A worker, which needs no swap, keeps it from one item to the
    next: a map that draws an odd number of such values per item gets other numbers with
    ``num_workers=0`` than with one worker.) The caller's cache is cleared by a swap too.

    Not reentrant; the pipeline's states start as a copy of the caller's at the first swap.
    """

    __slots__ = ("_python", "_callers_python", "_torch", "_callers_torch", "_numpy", "_callers_numpy")

    def __init__(self) -> None:
        self._python: Any = None
        self._callers_python: Any = None
        self._torch: Optional[torch.Tensor] = None  # None: not swapped in yet
        self._callers_torch: Any = None  # (set by swap_in, read by swap_out)
        self._numpy: Any = None  # a bit generator (or a get_state() tuple); None: not seen yet
        self._callers_numpy: Any = None

    def swap_in(self) -> None:
        """Install the pipeline's global RNG states, keeping the caller's aside; the caller
        must :meth:`swap_out` (in a ``finally``) before it draws again."""
        numpy_random = sys.modules.get("numpy.random")  # (not imported: no global state yet)
        self._callers_numpy = None if numpy_random is None else _swap_numpy(numpy_random, self._numpy)
        self._callers_python = random.getstate()
        self._callers_torch = _TORCH.get_state()
        if self._torch is not None:
            random.setstate(self._python)
            _TORCH.set_state(self._torch)

    def swap_out(self) -> None:
        """Keep the pipeline's global RNG states aside and put the caller's back."""
        self._python = random.getstate()
        self._torch = _TORCH.get_state()
        random.setstate(self._callers_python)
        _TORCH.set_state(self._callers_torch)
        numpy_random = sys.modules.get("numpy.random")  # (the block may have imported it)
        if numpy_random is not None:
            self._numpy = _swap_numpy(numpy_random, self._callers_numpy)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the block with the pipeline's global RNG states; the caller's are restored after."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    def next_item(self) -> None:
        """Between two items produced within one :meth:`active` block: clear numpy's legacy
        Gaussian cache, as a swap does."""
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            _swap_numpy(numpy_random, _numpy_now(numpy_random))
