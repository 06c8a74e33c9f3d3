"""The worker loop that restores from captured graph states, driven in-process: captures paced
by production time, and the registered state functions that workers of each start method get."""

import unittest
from typing import Any

import pytest
from suite_case import SuiteTestCase
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from worker_driver import items_of, reset, serve

from torchdata_snapshot import register_state_functions
from torchdata_snapshot._errors import StateCaptureError
from torchdata_snapshot.checkpoint.worker_loop import ReplayingWorkerLoop
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core import plugins
from torchdata_snapshot.core.options import RestoreOptions, WorkerOptions
from torchdata_snapshot.core.transport.channel import make_pipe_pair
from torchdata_snapshot.core.worker.entry import installed_loop
from torchdata_snapshot.core.worker.loop import WorkerLoop
from torchdata_snapshot.graph_state.state_functions import StateFunctions
from torchdata_snapshot.graph_state.worker_loop import StatefulWorkerLoop
from torchdata_snapshot.graph_state.worker_states import carried_state_functions


class FakeClock:
    """Stands in for the worker module's ``time``: it moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter
    thread_time = perf_counter  # (the worker has no other thread the test runs)


class Timed(IterDataPipe):
    """A stateful source whose items take 1 ms each and whose state takes 0.5 ms to capture."""

    def __init__(self, clock: FakeClock, n: int) -> None:
        self.clock, self.n, self.position = clock, n, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while self.position < self.n:
            self.clock.now += 0.001
            self.position += 1
            yield self.position - 1

    def state_dict(self) -> Any:
        self.clock.now += 0.0005
        return self.position

    def load_state_dict(self, state: Any) -> None:
        self.position = state


class Registered(IterDataPipe):
    """A DataPipe without state methods, made resumable by registered state functions."""

    def __iter__(self) -> Any:
        yield from range(3)


class RegisteredElsewhere(Registered):
    pass


def registered_state(dp: Registered) -> dict:
    return {}


def registered_load(dp: Registered, state: dict) -> None:
    pass


class TestStatefulWorker(SuiteTestCase):
    def test_captures_are_paced_by_production_time_not_by_waits_for_credit(self) -> None:
        from torchdata_snapshot.core.worker import loop as worker
        from torchdata_snapshot.graph_state import worker_states

        clock = FakeClock()
        self.monkeypatch.setattr(worker, "time", clock)  # its deadlines
        self.monkeypatch.setattr(worker_states, "time", clock)  # the pacer's clock and a capture's cost
        channel, endpoint, _ = make_pipe_pair()
        options = WorkerOptions(restore=RestoreOptions(max_items_between_captures=100))
        loop = StatefulWorkerLoop(Timed(clock, 1000), endpoint, WorkerInfo(1, 0), options=options)
        positions = []

        def step(request: Any) -> None:  # serve one request; read what it sent (a pipe is bounded)
            channel.send(request)
            loop.run_until_idle()
            while channel.poll():
                response = channel.recv(timeout_s=1)
                if isinstance(response, m.StateMarkResponse):
                    positions.append(response.position)

        step(reset())
        for _ in range(400):  # one item of credit at a time, then a second of training
            step(m.GetNextRequest(0, 1))
            clock.now += 1.0
        step(m.TerminateRequest())
        # The first two captures after the first two items; then as often as 1% of the production
        # time allows: a 0.5 ms capture per 1 ms item is one capture every 50 items (counting the
        # second of waiting per item, it would be after every item).
        assert positions[:4] == [1, 2, 52, 102]
        assert all(b - a == 50 for a, b in zip(positions[1:], positions[2:])), positions

    def test_workers_are_sent_the_registered_state_functions_of_their_graph(self) -> None:
        register_state_functions(Registered, registered_state, registered_load)
        register_state_functions(RegisteredElsewhere, lambda dp: {}, lambda dp, state: None)
        graph = Registered().map(str)
        for start_method in ("fork", "spawn", "forkserver"):
            carried = carried_state_functions(graph, WorkerOptions(), start_method)
            assert carried == (StateFunctions(Registered, registered_state, registered_load),), "the graph's"
        replaying = WorkerOptions(restore=RestoreOptions(stateful=False))
        assert carried_state_functions(graph, replaying, "spawn") == (), "workers that capture nothing"
        assert carried_state_functions(RegisteredElsewhere(), WorkerOptions(), "fork"), "fork does not pickle"
        with pytest.raises(
            StateCaptureError, match=r"<lambda>.* registered for .*RegisteredElsewhere .*module level"
        ):
            carried_state_functions(RegisteredElsewhere(), WorkerOptions(), "spawn")

    def test_a_replay_from_a_captured_state_replays_only_the_items_after_it(self) -> None:
        first = serve(
            Timed(FakeClock(), 10), [reset(), m.GetNextRequest(0, 3)], loop=StatefulWorkerLoop,
            max_items_between_captures=1,
        )  # fmt: skip
        mark = next(r for r in first if isinstance(r, m.StateMarkResponse) and r.position == 2)
        source = Timed(FakeClock(), 10)
        responses = serve(
            source, [reset(), m.ReplayRequest(0, 1, state=(2, mark.state)), m.GetNextRequest(0, 2)],
            loop=StatefulWorkerLoop,
        )  # fmt: skip
        assert responses[1] == m.ReplayResponse(0, 1)
        assert items_of(responses) == [3, 4], "loaded after item 2, item 3 replayed and dropped"
        assert serve(source, [reset(), m.GetStateRequest()], loop=StatefulWorkerLoop)[-1].snapshot.stateful

    def test_the_graph_made_resumable_answers_torchs_child_check_once(self) -> None:
        """The DataPipes the stateful loop runs (some changed into resumable subclasses) fail no
        ``_is_child_datapipe`` lookup per item (see test_child_checks)."""
        failed = []
        fallback = IterDataPipe.__getattr__

        def recording(dp: Any, name: str) -> Any:
            if name == "_is_child_datapipe":
                failed.append(type(dp).__name__)
            return fallback(dp, name)

        self.monkeypatch.setattr(IterDataPipe, "__getattr__", recording)
        graph = IterableWrapper(range(40)).shuffle().sharding_filter().map(abs)
        responses = serve(
            graph, [reset(), m.GetNextRequest(0, 100), m.GetStateRequest()], loop=StatefulWorkerLoop
        )
        assert responses[-1].snapshot.stateful and sorted(items_of(responses)) == list(range(40))
        assert failed == []

    def test_handlers_table_covers_every_request_the_main_process_sends(self) -> None:
        assert set(StatefulWorkerLoop.HANDLERS) == {*WorkerLoop.HANDLERS, m.ReplayRequest}

    def test_a_worker_runs_this_loop_where_it_is_installed_else_a_less_capable_one(self) -> None:
        self.addCleanup(plugins.installed.cache_clear)
        plugins.installed.cache_clear()
        assert installed_loop() is StatefulWorkerLoop
        missing = ("no_such_package.worker_loop", "StatefulWorkerLoop")
        replaying = plugins.FEATURES["worker_loop"][-1]
        self.monkeypatch.setattr(
            plugins, "FEATURES", {**plugins.FEATURES, "worker_loop": (missing, replaying)}
        )
        plugins.installed.cache_clear()
        assert installed_loop() is ReplayingWorkerLoop, "restores by replay"
        self.monkeypatch.setattr(plugins, "FEATURES", {**plugins.FEATURES, "worker_loop": (missing,)})
        plugins.installed.cache_clear()
        assert installed_loop() is WorkerLoop, "streams"


if __name__ == "__main__":
    unittest.main()
