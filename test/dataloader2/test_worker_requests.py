"""The core's worker loop serves its requests: pause, resume, limit, GetStateRequest, a new
epoch; an unknown request or a failing handler is answered with an error and the loop keeps
serving; and it serves no ReplayRequest, which is the checkpoint's."""

import unittest
from typing import Any, List, Optional

import pytest
from suite_case import SuiteTestCase
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from worker_driver import items_of, reset, serve

from torchdata_snapshot._errors import ProtocolError, StateCaptureError
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.transport.channel import make_pipe_pair
from torchdata_snapshot.core.worker.loop import WorkerLoop


class _Unpicklable:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise TypeError("cannot pickle a file handle")


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
            return {"seen": self.seen, "handle": _Unpicklable()}
        return {"seen": self.seen}


def _limit_fn(dp: Any, n: Optional[int]) -> Any:
    return dp.header(n)


class TestWorkerRequests(SuiteTestCase):
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

    def test_the_streaming_loop_knows_no_checkpoint(self) -> None:
        responses = serve(
            IterableWrapper(range(10)).sharding_filter(),
            [reset(), m.GetNextRequest(0, 4), m.ReplayRequest(0, 2), m.GetStateRequest()],
        )
        batches = [r for r in responses if isinstance(r, m.ItemsResponse)]
        assert items_of(batches) == [0, 1, 2, 3]
        assert all(b.digests is None and b.taken is None for b in batches), "no digest, no position"
        refused = next(r for r in responses if isinstance(r, m.ErrorResponse))
        with pytest.raises(ProtocolError, match="does not handle request 'ReplayRequest'"):
            refused.exc.reraise()
        assert not responses[-1].snapshot.stateful

    def test_the_loop_exits_when_the_parent_is_gone(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        channel.send(reset())
        channel.close()
        WorkerLoop(IterableWrapper(range(3)), endpoint, WorkerInfo(1, 0)).run()  # returns instead of hanging

    def test_handlers_table_covers_every_request_of_a_streaming_epoch(self) -> None:
        assert set(WorkerLoop.HANDLERS) == {
            m.ResetEpochRequest,
            m.GetNextRequest,
            m.PauseRequest,
            m.ResumeRequest,
            m.LimitRequest,
            m.GetStateRequest,
            m.TerminateRequest,
        }, "ReplayRequest is the checkpoint's (test_worker_replay.py)"


if __name__ == "__main__":
    unittest.main()
