"""The reading service's workers keep their C heap between items (how and why:
torchdata_snapshot.core.worker.heap, test_worker_heap.py), under every start method; the main
process, the user's, keeps its own; a user who tuned malloc keeps their settings."""

from __future__ import annotations

import unittest
from typing import Any

import pytest
from conftest import start_methods
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot import MultiProcessingReadingService
from torchdata_snapshot.core.worker import heap


def kept_heap(_: Any) -> bool:
    return heap.kept()


@pytest.mark.skipif(heap._glibc_version() is None, reason="the heap's thresholds are glibc's")
class TestWorkersKeepTheirHeap(SuiteTestCase):
    def worker_kept_its_heap(self, context: str) -> bool:
        rs = MultiProcessingReadingService(num_workers=1, multiprocessing_context=context)
        (kept,) = self.make_dl(IterableWrapper([0]).map(kept_heap), rs)
        return kept

    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    def test_a_worker_keeps_its_heap(self, context: str) -> None:
        assert not heap.kept()  # the main process is the user's
        assert self.worker_kept_its_heap(context)

    def test_a_user_who_tuned_malloc_keeps_their_thresholds(self) -> None:
        # A spawned worker starts with the environment of now (a forkserver's, with the one its
        # server started with; a forked one with this process's, which does not change).
        self.monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))
        assert not self.worker_kept_its_heap("spawn")


instantiate_parametrized_tests(TestWorkersKeepTheirHeap)


if __name__ == "__main__":
    unittest.main()
