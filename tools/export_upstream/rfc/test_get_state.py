import queue
import threading
import unittest
from unittest import TestCase

from torchdata.dataloader2.communication.iter import DataPipeBehindQueues
from torchdata.dataloader2.communication.messages import (
    GetNextResponse,
    GetStateResponse,
    PauseResponse,
    ResetEpochResponse,
)
from torchdata.dataloader2.communication.protocol import (
    IterDataPipeQueueProtocolClient,
    IterDataPipeQueueProtocolServer,
)
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.utils import WorkerInfo
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe
from torchdata.datapipes.map import SequenceWrapper


class _Counted(IterDataPipe):
    """A DataPipe with a ``state_dict()``: how many items it yielded."""

    def __init__(self, source):
        self.source = source
        self.count = 0

    def __iter__(self):
        self.count = 0
        for x in self.source:
            self.count += 1
            yield x

    def state_dict(self):
        return {"count": self.count}


class _NoState(IterDataPipe):
    """A DataPipe whose ``state_dict()`` raises, or returns what cannot be sent to another process."""

    def __init__(self, source, unpicklable):
        self.source = source
        self.unpicklable = unpicklable

    def __iter__(self):
        yield from self.source

    def state_dict(self):
        if self.unpicklable:
            return {"lock": threading.Lock()}
        raise ValueError("no state here")


class TestGetStateRequest(TestCase):
    r"""
    The queue-based loop of a worker answers ``GetStateRequest`` between two items, with the
    worker's ``WorkerSnapshot``, and goes on where it was.
    """

    def setUp(self) -> None:
        requests, responses = queue.Queue(), queue.Queue()
        self.client = IterDataPipeQueueProtocolClient(requests, responses)
        self.server = IterDataPipeQueueProtocolServer(requests, responses)
        self._serve(_Counted(IterableWrapper(range(10))))

    def _serve(self, datapipe) -> None:
        """The loop of worker 1 of 2, serving ``datapipe``."""
        self.loop = DataPipeBehindQueues(
            datapipe,
            self.server,
            process_name="worker process",
            loop_id=1,
            worker_info=WorkerInfo(2, 1),
            custom_reset_fn=None,
            blocking_request_get=False,
        )

    def _ask(self, request, response_type):
        """Send a request (a method of the client); the loop serves it; its response."""
        request()
        next(self.loop)
        response = self.client.response_queue.get(timeout=10)
        self.client.request_served(response)
        self.assertIsInstance(response, response_type)
        return response

    def _reset(self) -> None:
        self._ask(lambda: self.client.request_reset_epoch(SeedGenerator(0), None), ResetEpochResponse)

    def _next(self):
        return self._ask(self.client.request_next, GetNextResponse).value

    def _state(self):
        return self._ask(self.client.request_get_state, GetStateResponse).snapshot

    def test_state_between_two_items(self) -> None:
        self._reset()
        self.assertEqual([self._next() for _ in range(3)], [0, 1, 2])
        snapshot = self._state()
        self.assertEqual((snapshot.worker_id, snapshot.role), (1, "worker"))
        self.assertEqual((snapshot.produced, snapshot.sent, snapshot.buffered), (3, 3, 0))
        self.assertEqual(snapshot.datapipe_yields, {"0:_Counted": 3, "1:IterableWrapperIterDataPipe": 3})
        self.assertEqual(snapshot.datapipe_states, {"0:_Counted": {"count": 3}})
        self.assertFalse(snapshot.paused)
        self.assertEqual(self._next(), 3, "the loop goes on with the next item")

    def test_state_of_an_epoch_not_started_counts_nothing(self) -> None:
        self._reset()
        self.assertEqual([self._next() for _ in range(4)], [0, 1, 2, 3])
        self._reset()
        snapshot = self._state()
        self.assertEqual((snapshot.produced, snapshot.sent), (0, 0))
        self.assertEqual(set(snapshot.datapipe_yields.values()), {0})
        self.assertEqual(self._next(), 0)

    def test_state_while_paused(self) -> None:
        self._reset()
        self._next()
        self._ask(self.client.request_pause, PauseResponse)
        snapshot = self._state()
        self.assertTrue(snapshot.paused)
        self.assertEqual(snapshot.produced, 1)

    def test_what_a_datapipe_cannot_give_is_absent_and_the_loop_goes_on(self) -> None:
        source = SequenceWrapper(range(10)).to_iter_datapipe()  # a MapDataPipe keeps no count
        self._serve(_NoState(_NoState(source, unpicklable=True), unpicklable=False))
        self._reset()
        self.assertEqual([self._next() for _ in range(2)], [0, 1])
        snapshot = self._state()
        self.assertEqual(snapshot.datapipe_states, {})
        self.assertEqual(
            snapshot.datapipe_yields, {"0:_NoState": 2, "1:_NoState": 2, "2:MapToIterConverterIterDataPipe": 2}
        )
        self.assertEqual(self._next(), 2, "the loop goes on with the next item")

    def test_a_state_only_answers_its_own_request(self) -> None:
        self.client.request_next()
        self.server.get_new_request()
        with self.assertRaisesRegex(Exception, "state to another type of request"):
            self.server.response_get_state(None)


if __name__ == "__main__":
    unittest.main()
