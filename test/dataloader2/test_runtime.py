"""Runtimes on their own: the graph running in worker processes (``WorkerPool``) or in this
process (``InProcess``), driven through the ``Runtime`` protocol as the reading service drives
it, behind the outlet; and the checkpoint recorded at the user's position."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import psutil
import pytest
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._checkpoint import graph_identity
from torchdata_snapshot._in_process import InProcess
from torchdata_snapshot._options import FaultOptions, RestoreOptions, WorkerOptions
from torchdata_snapshot._outlet import Outlet
from torchdata_snapshot._runtime import Runtime, checkpoint_of, start_runtime
from torchdata_snapshot._worker_pool import WorkerPool

Running = Tuple[Runtime, Outlet]
GRAPH = graph_identity(IterableWrapper(range(10)).sharding_filter())


def _children() -> List[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


@pytest.fixture(params=[0, 2], ids=["in_process", "two_workers"])
def running(request: pytest.FixtureRequest) -> Iterator[Running]:
    before = {p.pid for p in _children()}
    runtime, outlet = start_runtime(
        IterableWrapper(range(10)).sharding_filter(),
        request.param,
        "fork",
        (2, 2),
        WorkerOptions(restore=RestoreOptions(stateful=False)),
        FaultOptions(control_timeout_s=30.0, timeout_s=30.0),
        isolate_rng=True,
        read_ahead=False,
    )
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
    assert isinstance(runtime, InProcess if runtime.positions is None else WorkerPool)


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


def test_the_checkpoint_records_what_the_user_received(running: Running) -> None:
    runtime, outlet = running
    num_workers = 0 if isinstance(runtime, InProcess) else 2
    assert checkpoint_of(None, num_workers, GRAPH, -1, None, (1, 0), None)["epoch"] == -1
    it = iter(_start_epoch(running))
    [next(it) for _ in range(4)]
    state = checkpoint_of(running, num_workers, GRAPH, 0, None, (1, 0), None)
    assert state["epoch"] == 0 and state["delivered"] == 4 and state["status"] == "in_epoch"
    assert len(state["workers"]) == num_workers


def test_shutdown_is_idempotent(running: Running) -> None:
    runtime, _ = running
    runtime.shutdown(5.0)
    runtime.shutdown(5.0)
