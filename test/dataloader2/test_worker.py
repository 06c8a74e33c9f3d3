"""The core's worker loop, driven in-process: items stream in order under credit, in batches
bounded by count and bytes, and a failure follows the items before it (its requests are tested
in test_worker_requests.py; the restoring loops that extend it in test_worker_replay.py and
test_worker_states.py)."""

import pickle
import threading
import unittest
from typing import Any, List

import pytest
from suite_case import SuiteTestCase
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from worker_driver import Counting, items_of, reset, serve

from torchdata_snapshot._errors import ChangedFileError, RemoteTraceback
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.options import BatchingOptions, WorkerOptions
from torchdata_snapshot.core.transport.batches import items_message
from torchdata_snapshot.core.transport.channel import make_pipe_pair
from torchdata_snapshot.core.transport.item_codec import ItemDecoder
from torchdata_snapshot.core.worker.loop import WorkerLoop


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


if __name__ == "__main__":
    unittest.main()
