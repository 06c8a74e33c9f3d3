"""A process whose heap is kept reuses it: a churn of large tensors does not get new memory (a
page fault per page), as glibc's adaptive thresholds can make it do; a user who tuned malloc
keeps their settings. (That the reading service's workers keep theirs: test_worker_heap_loader.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest
from pathlib import Path
from typing import List

import heap_churn
import pytest
from heap_churn import given_new_memory
from suite_case import SuiteTestCase

from torchdata_snapshot.core.worker import heap

GLIBC = heap._glibc_version() is not None

#: A process that imports torch and the churn only (a heap of a known history), runs the churn,
#: with its thresholds fixed first if argv[1] says so, and prints its faults.
CHURN_SCRIPT = """
import json, sys
sys.path.insert(0, {helpers!r})  # where heap_churn is
import torch
from heap_churn import cycle_faults
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    from torchdata_snapshot.core.worker.heap import keep_heap
    assert keep_heap()
print(json.dumps(cycle_faults()))
"""

#: The environment variables through which a user tunes glibc's malloc thresholds.
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

#: How long the churn may take in a process of its own.
CHURN_LIMIT_S = 120


@pytest.mark.skipif(not GLIBC, reason="the heap's thresholds are glibc's")
class TestKeptHeap(SuiteTestCase):
    def churn_in_a_process(self, keep: bool) -> List[int]:
        script = CHURN_SCRIPT.format(helpers=str(Path(heap_churn.__file__).parent))
        env = {k: v for k, v in os.environ.items() if not heap.user_tuned_malloc({k: v})}
        done = subprocess.run(
            [sys.executable, "-c", script, "keep" if keep else "leave"],
            capture_output=True, text=True, timeout=CHURN_LIMIT_S, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def test_left_to_glibc_a_process_gives_its_heap_back_and_takes_it_again(self) -> None:
        faults = self.churn_in_a_process(keep=False)
        assert given_new_memory(faults) > 0, faults

    def test_with_its_heap_kept_a_process_reuses_it(self) -> None:
        faults = self.churn_in_a_process(keep=True)
        assert given_new_memory(faults) == 0, faults

    def test_the_user_settings_that_are_respected(self) -> None:
        assert not heap.user_tuned_malloc({})
        assert not heap.user_tuned_malloc({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
        for name in MALLOC_VARIABLES:
            assert heap.user_tuned_malloc({name: "1"})
        tunables = "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=1"
        assert heap.user_tuned_malloc({"GLIBC_TUNABLES": tunables})


class TestWithoutGlibc(unittest.TestCase):
    def test_other_c_libraries_are_left_alone(self) -> None:
        with pytest.MonkeyPatch.context() as patch:
            for name in (*MALLOC_VARIABLES, "GLIBC_TUNABLES"):
                patch.delenv(name, raising=False)
            patch.setattr(os, "confstr", lambda name: "musl 1.2")
            assert heap.keep_heap() is False
            assert not heap.kept()


if __name__ == "__main__":
    unittest.main()
