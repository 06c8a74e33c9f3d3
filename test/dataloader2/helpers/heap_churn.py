"""Large blocks made and freed, and the page faults each cycle of them takes (a cycle given new
memory faults a page in at a time; one that reuses the heap takes none). Imports torch only, so
that a process running it has a heap of a known history."""

from __future__ import annotations

import resource
from typing import Any, List

import torch

#: A cycle that takes more page faults than this was given new memory (1 MB of 4 KB pages; a
#: cycle given back its 24 MB takes 6,000).
NEW_MEMORY_FAULTS = 256


def cycle_faults(_: Any = None, cycles: int = 20) -> List[int]:
    """The page faults of each of ``cycles`` cycles of three 8 MB tensors made and freed, after
    three that settle the heap.

    Left to glibc, the first blocks get pages of their own (they are over the mmap threshold a
    process starts with) and their free raises the thresholds to about 8 MB (mmap) and 16 MB
    (trim): the blocks then come from the heap, and when a free leaves more than that at its top,
    it is given back and taken again by the next cycle (1 to 5 of 20 cycles, in a process that
    imported torch only). With the thresholds a worker keeps, no cycle after the first three does."""

    def cycle() -> None:
        blocks = [torch.full((2 << 20,), float(i)) for i in range(3)]
        del blocks

    for _ in range(3):
        cycle()
    faults = []
    for _ in range(cycles):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cycle()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


def given_new_memory(faults: List[int]) -> float:
    """The share of the cycles that were given new memory."""
    return sum(f > NEW_MEMORY_FAULTS for f in faults) / len(faults)
