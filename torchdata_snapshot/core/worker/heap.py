"""A worker's C heap: thresholds fixed at start, so that it is not given back and taken again
between two items.

glibc's ``malloc`` adapts two thresholds as a process runs: a block above the *mmap threshold*
gets pages of its own, and the top of the heap goes back to the system once more than the *trim
threshold* is free there. A worker whose map makes a large tensor per item (1 MB, say), freed once
the next one exists, can settle into a cycle where each item grows the heap and a free trims it
again, depending on where earlier blocks happen to lie: every item's memory is then new to the
process, and its first write takes a page fault per page. In about half the runs of a 1 MB item
benchmark with one worker, that tripled the time the map took (160 page faults an item) and
halved throughput; a freshly started process falls into it with two 4 MB blocks.

:func:`keep_heap` fixes the thresholds at the values glibc's own adaptation ends at, once it has
seen blocks of up to 32 MiB: the mmap threshold at 32 MiB, the trim threshold at twice that. A
worker then keeps up to 64 MiB of freed heap for its next items instead of giving it back. It is
done in workers only (the main process is the user's), with glibc only (elsewhere nothing
changes), and never when the user tuned ``malloc`` through its environment variables, whose
values then hold. ``mallopt`` is a documented C function, called through ``ctypes``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping, Optional

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_heap", "kept", "user_tuned_malloc"]

logger = logging.getLogger(__name__)

#: Blocks up to this size come from the heap (glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of the heap kept for later blocks (twice the mmap threshold, as glibc
#: sets it when it adapts).
TRIM_THRESHOLD_BYTES = 64 << 20

# ``mallopt`` parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Whether :func:`keep_heap` fixed this process's thresholds.
_kept = False

#: The environment variables through which a user tunes glibc's ``malloc`` thresholds.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_tuned_malloc(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` sets glibc's ``malloc`` thresholds (its variables or its tunables)."""
    return any(name in environ for name in _USER_SETTINGS) or "glibc.malloc." in environ.get(
        "GLIBC_TUNABLES", ""
    )


def _glibc_version() -> Optional[str]:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):  # no such name on this platform
        return None
    return version if version and version.startswith("glibc") else None


def kept() -> bool:
    """Whether this process's ``malloc`` thresholds were fixed (a worker's, where glibc has them)."""
    return _kept


def keep_heap() -> bool:
    """Fix this process's ``malloc`` thresholds (see the module's docstring); ``True`` if it did."""
    global _kept
    if user_tuned_malloc(os.environ) or _glibc_version() is None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    logger.debug("heap thresholds %s", "fixed" if done else "left to malloc: mallopt refused them")
    _kept = done
    return done
