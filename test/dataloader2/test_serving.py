"""The serving loop both process loops share: one table maps a request type to its handler, a
request without one or a handler that fails is answered with an error and serving goes on, and
pause, resume, limit and terminate act on the graph as DataLoader2 means them."""

import unittest
from typing import Any, List

from torch.testing._internal.common_utils import TestCase
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.graph import graph_datapipes
from torchdata_snapshot.core.serving import ServingLoop
from torchdata_snapshot.core.transport.channel import ParentGone


class Served(ServingLoop):
    """A serving loop over ``datapipe`` whose answers are kept in ``replies``."""

    def __init__(self, datapipe: Any) -> None:
        self.datapipe = datapipe
        self.name = "the served loop"
        self.replies: List[m.Response] = []

    def _reply(self, response: m.Response) -> None:
        self.replies.append(response)

    def _datapipes(self) -> List[Any]:
        return [dp for _, dp in graph_datapipes(self.datapipe)]


class Recording(IterDataPipe):
    def __init__(self, source: IterDataPipe) -> None:
        self.source, self.calls = source, []

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from self.source

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


def _take_two(datapipe: Any, num_batches: Any) -> Any:
    return datapipe.header(num_batches)


class TestServingLoop(TestCase):
    def test_pause_and_resume_act_on_the_graphs_threads_and_the_users_functions(self) -> None:
        recording = Recording(IterableWrapper(range(5)))
        loop = Served(recording)
        loop._handle(m.PauseRequest(lambda dp: dp.map(abs)))
        self.assertTrue(loop.paused)
        self.assertEqual(recording.calls, ["pause"])
        loop._handle(m.ResumeRequest(None))
        self.assertFalse(loop.paused)
        self.assertEqual(recording.calls, ["pause", "resume"])
        self.assertEqual(loop.replies, [m.PauseResponse(), m.ResumeResponse()])

    def test_a_limit_takes_the_workers_share_when_it_has_one(self) -> None:
        loop = Served(IterableWrapper(range(10)))
        loop._handle(m.LimitRequest(7, _take_two, 2))
        self.assertEqual(list(loop.datapipe), [0, 1])
        loop._handle(m.LimitRequest(3, _take_two))
        self.assertEqual(list(loop.datapipe), [0, 1], "the share of all workers, without one's own")
        self.assertEqual(loop.replies, [m.LimitResponse(), m.LimitResponse()])

    def test_an_unknown_request_or_a_failing_handler_is_answered_and_serving_goes_on(self) -> None:
        loop = Served(IterableWrapper(range(3)))
        loop._handle(m.GetNextRequest(0, 1))  # not in this loop's table
        loop._handle(m.PauseRequest(lambda dp: 1 / 0))
        loop._handle(m.TerminateRequest())
        unknown, failed, goodbye = loop.replies
        self.assertIsInstance(unknown, m.ErrorResponse)
        self.assertIsInstance(failed, m.ErrorResponse)
        with self.assertRaisesRegex(
            ProtocolError, "the served loop does not handle request 'GetNextRequest'"
        ):
            unknown.exc.reraise()
        with self.assertRaises(ZeroDivisionError):
            failed.exc.reraise()
        self.assertEqual(goodbye, m.TerminateResponse())
        self.assertTrue(loop.terminated)

    def test_a_parent_that_is_gone_ends_the_loop_instead_of_an_answer(self) -> None:
        class Orphaned(Served):
            def _on_pause(self, request: m.PauseRequest) -> None:
                raise ParentGone("the main process is gone")

        Orphaned.HANDLERS = {**Served.HANDLERS, m.PauseRequest: "_on_pause"}
        loop = Orphaned(IterableWrapper(range(3)))
        with self.assertRaises(ParentGone):
            loop._handle(m.PauseRequest())
        self.assertEqual(loop.replies, [])


if __name__ == "__main__":
    unittest.main()
