"""The worker loop, driven in-process: requests go in a pipe, the loop runs, responses come out."""

import pickle
import threading
import unittest
from array import array
from typing import Any, List, Optional

import pytest
from suite_case import SuiteTestCase
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from torchdata_snapshot import register_state_functions
from torchdata_snapshot._errors import (
    ChangedFileError,
    ProtocolError,
    RemoteTraceback,
    ReplayDivergenceError,
    StateCaptureError,
)
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain, chain_hex
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.options import BatchingOptions, RestoreOptions, WorkerOptions
from torchdata_snapshot.core.transport.batches import items_message
from torchdata_snapshot.core.transport.channel import make_pipe_pair
from torchdata_snapshot.core.transport.item_codec import ItemDecoder
from torchdata_snapshot.core.worker.loop import WorkerLoop
from torchdata_snapshot.graph_state.state_functions import StateFunctions
from torchdata_snapshot.graph_state.worker_states import carried_state_functions


def serve(
    datapipe: Any,
    requests: List[Any],
    batching: BatchingOptions = BatchingOptions(),
    init_error: Optional[Any] = None,
    verify_replay: bool = True,
    max_items_between_captures: int = 1024,
) -> List[Any]:
    """Send ``requests`` one by one (then a terminate), letting the loop finish the work of each
    before the next; return the responses (read after each request: a pipe is bounded)."""
    channel, endpoint, _ = make_pipe_pair()
    restore = RestoreOptions(
        verify_replay=verify_replay, max_items_between_captures=max_items_between_captures
    )
    options = WorkerOptions(batching=batching, restore=restore)
    loop = WorkerLoop(datapipe, endpoint, WorkerInfo(1, 0), options=options, init_error=init_error)
    responses = []
    for request in [*requests, m.TerminateRequest()]:
        channel.send(request)
        loop.run_until_idle()
        while channel.poll():
            responses.append(channel.recv(timeout_s=1))
    assert loop.terminated
    assert isinstance(responses[-1], m.TerminateResponse)
    return responses[:-1]


def reset(epoch: int = 0, seed: int = 0) -> m.ResetEpochRequest:
    return m.ResetEpochRequest(SeedGenerator(seed), None, epoch=epoch)


def items_of(responses: List[Any]) -> List[Any]:
    out: List[Any] = []
    for r in responses:
        if isinstance(r, m.ItemsResponse):
            out.extend(ItemDecoder.decode(r.count, r.payload))
    return out


class Counting(IterDataPipe):
    """Counts how many items it was asked for: production must follow credit."""

    def __init__(self, source: IterDataPipe) -> None:
        self.source = source
        self.pulled = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for x in self.source:
            self.pulled += 1
            yield x


def batch_sizes(responses: List[Any]) -> List[int]:
    return [r.count for r in responses if isinstance(r, m.ItemsResponse)]


class Gate(IterDataPipe):
    """Yields 0, 1, then waits for ``release`` before yielding 2: a slow item."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield 0
        yield 1
        assert self.release.wait(30)
        yield 2


def _fail_at_2(x: int) -> int:
    if x == 2:
        raise KeyError("no such sample")
    return x


def _file_gone_at_2(x: int) -> int:
    if x == 2:
        raise ChangedFileError("data/shard_06.csv is gone")
    return x


class _NotPicklable:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise TypeError("cannot pickle a file handle")


def _unpicklable_at_1(x: int) -> Any:
    return _NotPicklable() if x == 1 else x


def _identity(x: Any) -> Any:
    return x


class FooRequest(m.Request):
    pass


def _broken_pause_fn(dp: Any) -> Any:
    raise RuntimeError("pause_fn failed")


class Pausable(IterDataPipe):
    def __init__(self, source: IterDataPipe) -> None:
        self.source = source
        self.calls: List[str] = []

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from self.source

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


class WithState(IterDataPipe):
    def __init__(self, source: IterDataPipe, unpicklable: bool = False, fail: bool = False) -> None:
        self.source = source
        self.seen = 0
        self.unpicklable = unpicklable
        self.fail = fail

    def __iter__(self):  # type: ignore[no-untyped-def]
        for x in self.source:
            self.seen += 1
            yield x

    def state_dict(self) -> Any:
        if self.fail:
            raise OSError("disk gone")
        if self.unpicklable:
            return {"seen": self.seen, "handle": _NotPicklable()}
        return {"seen": self.seen}


def _limit_fn(dp: Any, n: Optional[int]) -> Any:
    return dp.header(n)


def running_digests(items: List[Any]) -> List[int]:
    out, value = [], CHAIN_START
    for item in items:
        value = chain(value, item)
        out.append(value)
    return out


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


class TestWorker(SuiteTestCase):
    def test_items_stream_in_order_under_credit_then_stop(self) -> None:
        responses = serve(IterableWrapper(range(5)), [reset(), m.GetNextRequest(0, 10)])
        assert isinstance(responses[0], m.ResetEpochResponse) and responses[0].epoch == 0
        assert items_of(responses) == [0, 1, 2, 3, 4]
        assert responses[-1] == m.StopIterationResponse(0)

    def test_production_never_exceeds_credit(self) -> None:
        dp = Counting(IterableWrapper(range(100)))
        responses = serve(dp, [reset(), m.GetNextRequest(0, 3), m.GetStateRequest()])
        assert items_of(responses) == [0, 1, 2]
        snap = responses[-1].snapshot
        assert snap.produced == 3 and snap.sent + snap.buffered == 3
        assert dp.pulled == 3

    def test_credit_for_another_epoch_is_ignored(self) -> None:
        responses = serve(
            IterableWrapper(range(5)), [reset(epoch=1), m.GetNextRequest(0, 5), m.GetNextRequest(1, 2)]
        )
        assert items_of(responses) == [0, 1]

    def test_batches_are_bounded_by_count(self) -> None:
        responses = serve(
            IterableWrapper(range(50)), [reset(), m.GetNextRequest(0, 50)], BatchingOptions(max_items=3)
        )
        assert items_of(responses) == list(range(50))
        assert max(batch_sizes(responses)) <= 3

    def test_batches_are_bounded_by_bytes(self) -> None:
        items = [b"x" * 1000] * 8
        responses = serve(
            IterableWrapper(items), [reset(), m.GetNextRequest(0, 8)], BatchingOptions(max_bytes=1500)
        )
        assert items_of(responses) == items
        assert max(batch_sizes(responses)) <= 2, "a batch closes once it holds max_bytes"

    def test_items_are_not_held_back_by_a_slow_next_item(self) -> None:
        gate = Gate()
        channel, endpoint, _ = make_pipe_pair()
        loop = WorkerLoop(gate, endpoint, WorkerInfo(1, 0))
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        try:
            channel.send(reset())
            assert isinstance(channel.recv(timeout_s=10), m.ResetEpochResponse)
            channel.send(m.GetNextRequest(0, 3))
            got: List[Any] = []
            while len(got) < 2:  # 0 and 1 arrive while the worker is still busy with item 2
                got += items_of([channel.recv(timeout_s=10)])
            assert got == [0, 1]
            gate.release.set()
            assert items_of([channel.recv(timeout_s=10)]) == [2]
        finally:
            gate.release.set()
            channel.send(m.TerminateRequest())
            thread.join(10)
        assert not thread.is_alive()

    def test_a_graph_exception_follows_the_items_before_it_and_keeps_its_type(self) -> None:
        responses = serve(IterableWrapper(range(5)).map(_fail_at_2), [reset(), m.GetNextRequest(0, 5)])
        assert items_of(responses) == [0, 1]
        error = responses[-1]
        assert isinstance(error, m.WorkerExceptionResponse)
        with pytest.raises(KeyError, match=r"(?s)Caught KeyError in worker process 0.*no such sample"):
            error.exc.reraise()

    def test_an_error_of_the_package_raised_in_a_worker_is_its_message_with_its_traceback_as_cause(
        self,
    ) -> None:
        responses = serve(IterableWrapper(range(5)).map(_file_gone_at_2), [reset(), m.GetNextRequest(0, 5)])
        error = responses[-1]
        assert isinstance(error, m.WorkerExceptionResponse)
        with pytest.raises(ChangedFileError) as raised:
            pickle.loads(pickle.dumps(error)).exc.reraise()  # as it crosses the pipe
        # One short message, naming its entry once.
        self.assertExpectedInline(
            str(raised.value),
            """data/shard_06.csv is gone (troubleshooting: docs/troubleshooting.rst#changedfileerror)""",
        )
        cause = raised.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert str(cause).startswith(
            "ChangedFileError in worker process 0:\nTraceback (most recent call last):"
        )
        assert "in _file_gone_at_2" in str(cause), "the worker's frames"

    def test_an_unpicklable_item_is_reported_with_its_position(self) -> None:
        responses = serve(IterableWrapper(range(3)).map(_unpicklable_at_1), [reset(), m.GetNextRequest(0, 3)])
        assert items_of(responses) == [0]
        with pytest.raises(Exception, match="while pickling item 1 of epoch 0"):
            responses[-1].exc.reraise()

    def test_a_failing_outbox_thread_reports_its_error_and_the_loop_exits(self) -> None:
        from torchdata_snapshot.core.transport import outbox as outbox

        def message(batch: Any) -> m.ItemsResponse:
            response = items_message(batch)
            if ItemDecoder.decode(response.count, response.payload) == [3]:
                raise ValueError("cannot write 3")
            return response

        self.monkeypatch.setattr(outbox, "items_message", message)
        channel, endpoint, _ = make_pipe_pair()
        options = WorkerOptions(batching=BatchingOptions(max_items=1))
        loop = WorkerLoop(IterableWrapper(range(10)), endpoint, WorkerInfo(1, 0), options=options)
        channel.send(reset())
        channel.send(m.GetNextRequest(0, 10))
        loop.run()  # returns: it does not wait for requests it could never answer
        responses = []
        while channel.poll():
            responses.append(channel.recv(timeout_s=1))
        assert items_of(responses) == [0, 1, 2]
        assert isinstance(responses[-1], m.WorkerExceptionResponse)
        with pytest.raises(ValueError, match="(?s)in the outbox thread of worker process 0.*cannot write 3"):
            responses[-1].exc.reraise()

    def test_an_unknown_request_gets_an_error_response_and_the_loop_keeps_serving(self) -> None:
        responses = serve(IterableWrapper(range(2)), [FooRequest(), reset(), m.GetNextRequest(0, 2)])
        assert isinstance(responses[0], m.ErrorResponse) and responses[0].request_type == "FooRequest"
        with pytest.raises(ProtocolError, match="does not handle request 'FooRequest'"):
            responses[0].exc.reraise()
        assert items_of(responses) == [0, 1]

    def test_a_failing_handler_answers_with_an_error(self) -> None:
        responses = serve(
            IterableWrapper(range(2)), [reset(), m.PauseRequest(_broken_pause_fn), m.ResumeRequest()]
        )
        assert isinstance(responses[1], m.ErrorResponse) and responses[1].request_type == "PauseRequest"
        with pytest.raises(RuntimeError, match="while serving PauseRequest"):
            responses[1].exc.reraise()
        assert isinstance(responses[2], m.ResumeResponse)

    def test_nothing_is_produced_while_paused(self) -> None:
        dp = Pausable(IterableWrapper(range(10)))
        responses = serve(dp, [reset(), m.PauseRequest(), m.GetNextRequest(0, 4), m.GetStateRequest()])
        assert items_of(responses) == []
        snap = responses[-1].snapshot
        assert snap.paused and snap.produced == 0
        assert dp.calls == ["pause"]

    def test_resume_continues_where_pause_stopped(self) -> None:
        dp = Pausable(IterableWrapper(range(6)))
        requests = [
            reset(),
            m.GetNextRequest(0, 2),
            m.PauseRequest(),
            m.GetNextRequest(0, 5),
            m.ResumeRequest(),
        ]
        responses = serve(dp, requests)
        assert items_of(responses) == list(range(6))
        kinds = [type(r).__name__ for r in responses if not isinstance(r, m.ItemsResponse)]
        assert kinds == ["ResetEpochResponse", "PauseResponse", "ResumeResponse", "StopIterationResponse"]
        assert dp.calls == ["pause", "resume"]

    def test_get_state_pauses_threaded_datapipes_around_the_capture(self) -> None:
        dp = Pausable(IterableWrapper(range(3)))
        serve(dp, [reset(), m.GetStateRequest()])
        assert dp.calls == ["pause", "resume"]

    def test_get_state_reports_counts_yields_and_datapipe_states(self) -> None:
        dp = WithState(IterableWrapper(range(10))).map(_identity)
        responses = serve(dp, [reset(epoch=4), m.GetNextRequest(4, 3), m.GetStateRequest()])
        snap = responses[-1].snapshot
        assert (snap.worker_id, snap.role, snap.epoch) == (0, "worker", 4)
        assert (snap.produced, snap.sent + snap.buffered, snap.exhausted) == (3, 3, False)
        assert snap.datapipe_yields == {
            "0:MapperIterDataPipe": 3,
            "1:WithState": 3,
            "2:IterableWrapperIterDataPipe": 3,
        }
        assert snap.datapipe_states == {"1:WithState": {"seen": 3}}

    def test_an_unpicklable_state_names_the_datapipe_and_attribute(self) -> None:
        dp = WithState(IterableWrapper(range(3)), unpicklable=True)
        responses = serve(
            dp, [reset(), m.GetStateRequest(), m.GetStateRequest(include_datapipe_states=False)]
        )
        with pytest.raises(
            StateCaptureError, match=r"DataPipe 0:WithState .* cannot be pickled \(attribute 'handle'\)"
        ):
            responses[1].exc.reraise()
        assert isinstance(responses[2], m.GetStateResponse), "the loop keeps serving"

    def test_a_failing_state_dict_names_the_datapipe(self) -> None:
        responses = serve(WithState(IterableWrapper(range(3)), fail=True), [reset(), m.GetStateRequest()])
        with pytest.raises(
            StateCaptureError, match=r"state_dict\(\) of DataPipe 0:WithState .* raised OSError: disk gone"
        ):
            responses[1].exc.reraise()

    def test_a_new_epoch_drops_the_old_one_and_replays_with_the_same_seed(self) -> None:
        dp = IterableWrapper(range(20)).shuffle()
        requests = [reset(0, seed=5), m.GetNextRequest(0, 4), reset(1, seed=5), m.GetNextRequest(1, 20)]
        responses = serve(dp, requests)
        marks = [i for i, r in enumerate(responses) if isinstance(r, m.ResetEpochResponse)]
        first, second = items_of(responses[: marks[1]]), items_of(responses[marks[1] :])
        assert len(first) == 4 and sorted(second) == list(range(20))
        assert second[:4] == first, "same seed, same order"
        assert second != list(range(20)), "the shuffle is seeded, not skipped"

    def test_limit_applies_limit_fn_to_the_graph(self) -> None:
        responses = serve(
            IterableWrapper(range(10)), [m.LimitRequest(3, _limit_fn), reset(), m.GetNextRequest(0, 10)]
        )
        assert isinstance(responses[0], m.LimitResponse)
        assert items_of(responses) == [0, 1, 2]

    def test_an_init_error_answers_every_request(self) -> None:
        try:
            raise ImportError("no module named cv2")
        except ImportError:
            from torchdata._utils import ExceptionWrapper

            error = ExceptionWrapper(where="in worker process 0 while initializing it")
        responses = serve(IterableWrapper(range(3)), [reset(), m.GetStateRequest()], init_error=error)
        assert [type(r) for r in responses] == [m.ErrorResponse, m.ErrorResponse]
        with pytest.raises(ImportError, match="while initializing it"):
            responses[0].exc.reraise()

    def test_the_loop_exits_when_the_parent_is_gone(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        channel.send(reset())
        channel.close()
        WorkerLoop(IterableWrapper(range(3)), endpoint, WorkerInfo(1, 0)).run()  # returns instead of hanging

    def test_a_replay_drops_the_first_items_then_streams_the_rest(self) -> None:
        dp = Counting(IterableWrapper(range(10)))
        responses = serve(dp, [reset(), m.ReplayRequest(0, 4), m.GetNextRequest(0, 3), m.GetStateRequest()])
        assert responses[1] == m.ReplayResponse(0, 4)
        assert items_of(responses) == [4, 5, 6], "the replayed items never leave the worker"
        snap = responses[-1].snapshot
        assert snap.produced == 7 and snap.sent + snap.buffered == 7
        assert dp.pulled == 7

    def test_every_item_carries_the_running_digest_of_its_stream(self) -> None:
        responses = serve(
            IterableWrapper(range(10)), [reset(), m.GetNextRequest(0, 9)], BatchingOptions(max_items=2)
        )
        batches = [r for r in responses if isinstance(r, m.ItemsResponse)]
        assert [d for b in batches for d in array("Q", b.digests)] == running_digests(list(range(9)))
        off = serve(IterableWrapper(range(3)), [reset(), m.GetNextRequest(0, 3)], verify_replay=False)
        off_batches = [r for r in off if isinstance(r, m.ItemsResponse)]
        assert off_batches and all(r.digests is None for r in off_batches)

    def test_a_replay_is_checked_against_the_recorded_running_digest(self) -> None:
        recorded = chain_hex(running_digests(list(range(5)))[-1])
        good = serve(IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 5, recorded)])
        assert good[1] == m.ReplayResponse(0, 5)
        other = chain_hex(running_digests([0, 1, 2, 3, 99])[-1])
        bad = serve(IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 5, other)])
        assert isinstance(bad[1], m.ErrorResponse)
        with pytest.raises(
            ReplayDivergenceError,
            match=r"worker process 0: items 1\.\.5 of epoch 0 replayed differently .* not deterministic",
        ):
            bad[1].exc.reraise()
        unchecked = serve(
            IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 5, other)], verify_replay=False
        )
        assert unchecked[1] == m.ReplayResponse(0, 5), "verify_replay=False turns the check off"

    def test_after_a_replay_the_running_digest_goes_on_from_the_replayed_items(self) -> None:
        responses = serve(
            IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 4), m.GetNextRequest(0, 3)]
        )
        batches = [r for r in responses if isinstance(r, m.ItemsResponse)]
        assert [d for b in batches for d in array("Q", b.digests)] == running_digests(list(range(7)))[4:]

    def test_a_replay_past_the_end_of_the_stream_is_a_divergence(self) -> None:
        responses = serve(IterableWrapper(range(3)), [reset(), m.ReplayRequest(0, 5)])
        with pytest.raises(
            ReplayDivergenceError, match="ended after 3 items, but the checkpoint says .* received 5"
        ):
            responses[1].exc.reraise()

    def test_a_long_replay_reports_progress(self) -> None:
        from torchdata_snapshot.core.worker import loop as worker

        self.monkeypatch.setattr(worker, "REPLAY_HEARTBEAT_S", 0.0)
        responses = serve(IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 3)])
        assert responses[1:] == [m.ReplayProgressResponse(0, i) for i in (1, 2, 3)] + [m.ReplayResponse(0, 3)]

    def test_a_replay_must_follow_a_reset(self) -> None:
        responses = serve(
            IterableWrapper(range(10)), [reset(), m.GetNextRequest(0, 2), m.ReplayRequest(0, 3)]
        )
        with pytest.raises(ProtocolError, match="a replay must directly follow the reset"):
            responses[-1].exc.reraise()

    def test_handlers_table_covers_every_request_the_main_process_sends(self) -> None:
        served = set(WorkerLoop.HANDLERS)
        assert served == {
            m.ResetEpochRequest,
            m.ReplayRequest,
            m.GetNextRequest,
            m.PauseRequest,
            m.ResumeRequest,
            m.LimitRequest,
            m.GetStateRequest,
            m.TerminateRequest,
        }

    def test_captures_are_paced_by_production_time_not_by_waits_for_credit(self) -> None:
        from torchdata_snapshot.core.worker import loop as worker
        from torchdata_snapshot.graph_state import worker_states

        clock = FakeClock()
        self.monkeypatch.setattr(worker, "time", clock)  # its deadlines
        self.monkeypatch.setattr(worker_states, "time", clock)  # the pacer's clock and a capture's cost
        channel, endpoint, _ = make_pipe_pair()
        options = WorkerOptions(restore=RestoreOptions(max_items_between_captures=100))
        loop = WorkerLoop(Timed(clock, 1000), endpoint, WorkerInfo(1, 0), options=options)
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


if __name__ == "__main__":
    unittest.main()
