"""worker_init_fn as DataLoader2 users pass it: applied to each process's graph, with or without
worker processes; one that returns no DataPipe is refused with a TypeError wherever it runs."""

import unittest
from unittest import TestCase

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from torchdata_snapshot import MultiProcessingReadingService


def tenfold(x: int) -> int:
    return x * 10


def times_ten(datapipe: IterDataPipe, info: WorkerInfo) -> IterDataPipe:
    return datapipe.map(tenfold)


def three(datapipe: IterDataPipe, info: WorkerInfo) -> int:
    return 3


class TestWorkerInit(TestCase):
    def test_without_workers_the_reading_service_initializes_its_graph_with_it(self) -> None:
        rs = MultiProcessingReadingService(num_workers=0, worker_init_fn=times_ten)
        dl = DataLoader2(IterableWrapper(range(3)), reading_service=rs)
        try:
            assert list(dl) == [0, 10, 20]
        finally:
            dl.shutdown()
        bad = DataLoader2(
            IterableWrapper(range(3)),
            reading_service=MultiProcessingReadingService(num_workers=0, worker_init_fn=three),
        )
        try:
            with pytest.raises(TypeError, match="worker_init_fn returned int, not a DataPipe"):
                list(bad)
        finally:
            bad.shutdown()

    def test_in_a_worker_a_worker_init_fn_that_returns_no_datapipe_is_refused(self) -> None:
        rs = MultiProcessingReadingService(num_workers=1, worker_init_fn=three, timeout_s=60.0)
        dl = DataLoader2(IterableWrapper(range(3)), reading_service=rs)
        try:
            with pytest.raises(TypeError, match="worker_init_fn returned int, not a DataPipe"):
                list(dl)
        finally:
            dl.shutdown()


if __name__ == "__main__":
    unittest.main()
