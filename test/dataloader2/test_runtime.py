"""Runtimes on their own: the graph running in worker processes (``WorkerProcesses``) or in this
process (``InProcess``), driven through the ``Runtime`` protocol as the reading service drives
it, behind the outlet."""

from __future__ import annotations

import functools
import unittest
from typing import List, Tuple

import psutil
from pipelines import CONTEXT
from suite_case import SuiteTestCase
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot.core.main.in_process import InProcess
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.runtime import Runtime, start_workers
from torchdata_snapshot.core.main.worker_processes import WorkerProcesses
from torchdata_snapshot.core.options import FaultOptions, RestoreOptions, RuntimeOptions, WorkerOptions

Running = Tuple[Runtime, Outlet]


def _children() -> List[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def _start_epoch(running: Running, epoch: int = 0) -> Outlet:
    runtime, outlet = running
    runtime.start_epoch(outlet, epoch, SeedGenerator(7), None)
    outlet.start_epoch(epoch)
    return outlet


class RuntimeTests:
    """The tests of a runtime of ``num_workers`` workers (0: in this process), a mixin of the
    TestCase classes below (a TestCase of its own would be collected)."""

    num_workers = 0

    @functools.cached_property
    def running(self) -> Running:
        """The runtime and its outlet, shut down after the test, leaving no process behind."""
        before = {p.pid for p in _children()}
        datapipe = IterableWrapper(range(10)).sharding_filter()
        runtime: Runtime
        if self.num_workers:
            options = RuntimeOptions(
                num_workers=self.num_workers,
                multiprocessing_context=CONTEXT,
                prefetch=(2, 2),
                # (Whatever worker loop is installed: one that captures no states sends items only.)
                worker=WorkerOptions(restore=RestoreOptions(stateful=False)),
                faults=FaultOptions(control_timeout_s=30.0, timeout_s=30.0),
            )
            runtime = start_workers(datapipe, options)
        else:
            runtime = InProcess(datapipe, None)
        outlet = Outlet(runtime.end, runtime.positions)

        def shut_down() -> None:
            runtime.shutdown(5.0)
            assert {p.pid for p in _children()} - before == set(), "shutdown leaves no process behind"

        self.addCleanup(shut_down)
        return runtime, outlet

    def test_each_number_of_workers_gets_its_runtime(self) -> None:
        runtime, _ = self.running
        assert isinstance(runtime, InProcess if runtime.positions is None else WorkerProcesses)

    def test_an_epoch_yields_the_whole_graph_once(self) -> None:
        outlet = _start_epoch(self.running)
        items = list(outlet)
        assert items == list(range(10)), "round-robin over the workers is the sharded order"
        assert outlet.finished and outlet.delivered == 10

    def test_a_snapshot_reports_each_process_running_the_graph(self) -> None:
        runtime, _ = self.running
        outlet = _start_epoch(self.running)
        it = iter(outlet)
        [next(it) for _ in range(3)]
        snapshots = runtime.snapshot(outlet, 0, paused=False)
        expected = 1 if isinstance(runtime, InProcess) else 2
        assert len(snapshots) == expected
        assert sum(s.handed_on for s in snapshots) >= 3

    def test_shutdown_is_idempotent(self) -> None:
        runtime, _ = self.running
        runtime.shutdown(5.0)
        runtime.shutdown(5.0)


class TestRuntimeInProcess(RuntimeTests, SuiteTestCase):
    num_workers = 0


class TestRuntimeOfTwoWorkers(RuntimeTests, SuiteTestCase):
    num_workers = 2


if __name__ == "__main__":
    unittest.main()
