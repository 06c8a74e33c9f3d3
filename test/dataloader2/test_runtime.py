"""Runtimes on their own: the graph running in worker processes (``WorkerProcesses``) or in this
process (``InProcess``), driven through the ``Runtime`` protocol as the reading service drives
it, behind the outlet."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import psutil
import pytest
from pipelines import started_runtime
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot.core.main.in_process import InProcess
from torchdata_snapshot.core.main.outlet import Outlet
from torchdata_snapshot.core.main.runtime import Runtime
from torchdata_snapshot.core.main.worker_processes import WorkerProcesses

Running = Tuple[Runtime, Outlet]


def _children() -> List[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


@pytest.fixture(params=[0, 2], ids=["in_process", "two_workers"])
def running(request: pytest.FixtureRequest) -> Iterator[Running]:
    before = {p.pid for p in _children()}
    runtime, outlet = started_runtime(IterableWrapper(range(10)).sharding_filter(), request.param)
    try:
        yield runtime, outlet
    finally:
        runtime.shutdown(5.0)
    assert {p.pid for p in _children()} - before == set(), "shutdown leaves no process behind"


def _start_epoch(running: Running, epoch: int = 0) -> Outlet:
    runtime, outlet = running
    runtime.start_epoch(outlet, epoch, SeedGenerator(7), None, None)
    outlet.start_epoch_at(epoch, None)
    return outlet


def test_each_number_of_workers_gets_its_runtime(running: Running) -> None:
    runtime, _ = running
    assert isinstance(runtime, InProcess if runtime.positions is None else WorkerProcesses)


def test_an_epoch_yields_the_whole_graph_once(running: Running) -> None:
    outlet = _start_epoch(running)
    items = list(outlet)
    assert items == list(range(10)), "round-robin over the workers is the sharded order"
    assert outlet.finished and outlet.delivered == 10


def test_a_snapshot_reports_each_process_running_the_graph(running: Running) -> None:
    runtime, _ = running
    outlet = _start_epoch(running)
    it = iter(outlet)
    [next(it) for _ in range(3)]
    snapshots = runtime.snapshot(outlet, 0, paused=False)
    expected = 1 if isinstance(runtime, InProcess) else 2
    assert len(snapshots) == expected
    assert sum(s.handed_on for s in snapshots) >= 3


def test_shutdown_is_idempotent(running: Running) -> None:
    runtime, _ = running
    runtime.shutdown(5.0)
    runtime.shutdown(5.0)
