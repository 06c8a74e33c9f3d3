"""The main process's side of every worker's channel: one request to every worker, answers read
in parallel and kept in order, items read on the way kept in their streams; an error answer is
raised once every answer is read, and an exchange that does not complete leaves the links broken.
The workers here are the other ends of the pipes, written to by the test."""

import unittest
from typing import Any, List, Tuple

from torch.testing._internal.common_utils import TestCase

from torchdata_snapshot._errors import (
    ExceptionWrapper,
    ProtocolError,
    ReadingServiceError,
    WorkerTimeoutError,
)
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.main.links import WorkerLinks
from torchdata_snapshot.core.main.worker_record import WorkerRecord
from torchdata_snapshot.core.transport.channel import Endpoint, make_pipe_pair
from torchdata_snapshot.core.transport.item_codec import ItemEncoder


def items(epoch: int, *values: Any) -> m.ItemsResponse:
    encoder = ItemEncoder()
    for value in values:
        encoder.add(value)
    return m.ItemsResponse(epoch, *encoder.take(), None)


def error(request_type: str, exc: BaseException) -> m.ErrorResponse:
    try:
        raise exc
    except BaseException:
        return m.ErrorResponse(request_type, ExceptionWrapper(where="in a test worker"))


class Progress:
    def __init__(self) -> None:
        self.reports: List[Tuple[str, int, int, int]] = []

    def start(self) -> None:
        pass

    def report(self, where: str, epoch: int, position: int, target: int) -> None:
        self.reports.append((where, epoch, position, target))


class TestWorkerLinks(TestCase):
    def links(self, workers: int = 2, control_timeout_s: float = 5.0) -> Tuple[WorkerLinks, List[Endpoint]]:
        streams, endpoints = [], []
        for worker_id in range(workers):
            channel, endpoint, _ = make_pipe_pair()
            streams.append(WorkerRecord(worker_id, channel.bind(f"worker {worker_id}"), window=4))
            endpoints.append(endpoint)
            self.addCleanup(channel.close)
            self.addCleanup(endpoint.close)
        links = WorkerLinks(streams, control_timeout_s, None, None, None)
        links.epoch = 0
        for stream in streams:
            stream.start()
        return links, endpoints

    def test_every_worker_is_asked_and_the_items_before_its_answer_are_kept(self) -> None:
        links, (first, second) = self.links()
        first.send(items(0, "a", "b"))
        first.send(m.PauseResponse())
        second.send(m.PauseResponse())
        answers = links.request_all(lambda i: m.PauseRequest(), m.PauseResponse)
        self.assertEqual(answers, [m.PauseResponse(), m.PauseResponse()])
        self.assertEqual([first.recv(1), second.recv(1)], [m.PauseRequest(), m.PauseRequest()])
        self.assertEqual(list(links.streams[0].buffer), ["a", "b"], "they precede the answer in its stream")
        self.assertIsNone(links.broken)

    def test_an_error_answer_is_raised_once_every_answer_is_read(self) -> None:
        links, (first, second) = self.links()
        first.send(error("PauseRequest", ValueError("bad pause_fn")))
        second.send(m.PauseResponse())
        with self.assertRaisesRegex(ValueError, "bad pause_fn"):
            links.request_all(lambda i: m.PauseRequest(), m.PauseResponse)
        self.assertFalse(any(stream.channel.poll() for stream in links.streams), "no answer left behind")
        self.assertIsNone(links.broken, "the pipes can still be trusted")

    def test_an_unexpected_answer_leaves_the_links_broken(self) -> None:
        links, (first, second) = self.links()
        first.send(m.ResumeResponse())
        second.send(m.PauseResponse())
        with self.assertRaisesRegex(ProtocolError, "worker 0 answered ResumeResponse while PauseResponse"):
            links.request_all(lambda i: m.PauseRequest(), m.PauseResponse)
        with self.assertRaisesRegex(ReadingServiceError, "cannot continue after an interrupted exchange"):
            links.request_all(lambda i: m.ResumeRequest(), m.ResumeResponse)

    def test_a_silent_worker_times_out_and_leaves_the_links_broken(self) -> None:
        links, (only,) = self.links(workers=1, control_timeout_s=0.2)
        only.send(m.PauseResponse())  # its first answer (a starting process may take longer)
        links.request_all(lambda i: m.PauseRequest(), m.PauseResponse)
        with self.assertRaisesRegex(
            WorkerTimeoutError, r"worker 0 did not send ResumeResponse within 0\.2 s"
        ):
            links.request_all(lambda i: m.ResumeRequest(), m.ResumeResponse)
        self.assertIn("WorkerTimeoutError", links.broken or "")

    def test_a_long_replay_reports_its_progress_while_it_is_awaited(self) -> None:
        links, (only,) = self.links(workers=1)
        links.progress = progress = Progress()
        only.send(m.ReplayProgressResponse(0, 100))
        only.send(m.ReplayProgressResponse(0, 200))
        only.send(m.ReplayResponse(0, 250))
        answers = links.request_all(lambda i: m.ReplayRequest(0, 250), m.ReplayResponse)
        self.assertEqual(answers, [m.ReplayResponse(0, 250)])
        self.assertEqual(progress.reports, [("worker 0", 0, 100, 250), ("worker 0", 0, 200, 250)])


if __name__ == "__main__":
    unittest.main()
