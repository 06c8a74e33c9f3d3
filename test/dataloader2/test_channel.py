"""Channel: one pipe pair, bounded waits, a dead peer reported by name, pid and exit code."""

import multiprocessing
import os
import re
import signal
import threading
import time
import unittest
from typing import Any, Optional
from unittest import TestCase

import pytest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot._errors import WorkerDiedError, WorkerTimeoutError
from torchdata_snapshot.core.transport.channel import (
    ParentGone,
    ParentWatch,
    describe_exit,
    make_pipe_pair,
)

FORK = multiprocessing.get_context("fork")


def _exit_with(code: int) -> None:
    os._exit(code)


def _sleep_forever() -> None:
    time.sleep(600)


def _busy_then_answer(endpoint: Any, cpu_s: float) -> None:
    """Answer once started, then compute for ``cpu_s`` seconds of CPU time and answer again."""
    endpoint.send("started")
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass
    endpoint.send("done")


def _idle_after_answering(endpoint: Any) -> None:
    endpoint.send("started")
    time.sleep(600)


def _start_serving(target, *args):  # type: ignore[no-untyped-def]
    """``target(endpoint, *args)`` in a forked process that serves the channel returned."""
    channel, endpoint, child_ends = make_pipe_pair(FORK)
    process = FORK.Process(target=target, args=(endpoint, *args), daemon=True)
    process.start()
    for end in child_ends:
        end.close()
    return channel.bind("worker 1", process), process


def _start(target, *args):  # type: ignore[no-untyped-def]
    channel, endpoint, child_ends = make_pipe_pair(FORK)
    process = FORK.Process(target=target, args=args, daemon=True)
    process.start()
    for end in child_ends:
        end.close()
    return channel.bind("worker 1", process), process


class TestChannel(TestCase):
    def test_requests_and_responses_cross_in_order(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        channel.send("ping-1")
        channel.send("ping-2")
        assert endpoint.poll()
        assert endpoint.recv(timeout_s=1) == "ping-1"
        assert endpoint.recv(timeout_s=1) == "ping-2"
        assert endpoint.recv(timeout_s=0.01) is None  # nothing more: a bounded wait, not a hang
        endpoint.send("pong")
        assert channel.poll()
        assert channel.recv(timeout_s=1) == "pong"

    def test_a_silent_peer_times_out_with_a_named_error(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        channel.bind("worker 3")
        endpoint.send("started")
        assert channel.recv(timeout_s=1) == "started"
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=r"worker 3 did not send a response within 0\.2 s"):
            channel.recv(timeout_s=0.2)
        assert time.monotonic() - start < 5

    def test_a_first_answer_may_take_longer_than_the_timeout_a_starting_process_gets(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        channel.bind("worker 3")
        late = threading.Timer(0.5, endpoint.send, args=("started",))  # a slow start (spawn)
        late.start()
        try:
            assert channel.recv(timeout_s=0.1) == "started"
        finally:
            late.join(5)
        with pytest.raises(WorkerTimeoutError, match=r"within 0\.1 s"):
            channel.recv(timeout_s=0.1)  # started: the caller's bound applies again

    def test_a_control_wait_gives_a_process_that_computes_the_bound_again(self) -> None:
        channel, process = _start_serving(_busy_then_answer, 1.5)
        self.addCleanup(process.join, 5)
        self.addCleanup(process.kill)
        assert channel.recv(timeout_s=10) == "started"
        got = channel.recv(0.3, "ResetEpochResponse", option="control_timeout_s", while_busy=True)
        assert got == "done", "slow, not stuck: five times the bound, and it answers"

    def test_a_strict_bound_is_not_extended_for_a_process_that_computes(self) -> None:
        channel, process = _start_serving(_busy_then_answer, 30)
        self.addCleanup(process.join, 5)
        self.addCleanup(process.kill)
        assert channel.recv(timeout_s=10) == "started"
        with pytest.raises(
            WorkerTimeoutError, match=r"did not send an item within 0\.3 s; it is alive .*timeout_s"
        ):
            channel.recv(0.3, "an item", option="timeout_s")

    def test_a_process_that_uses_no_cpu_times_out_naming_the_setting(self) -> None:
        channel, process = _start_serving(_idle_after_answering)
        self.addCleanup(process.join, 5)
        self.addCleanup(process.kill)
        assert channel.recv(timeout_s=10) == "started"
        start = time.monotonic()
        with pytest.raises(
            WorkerTimeoutError,
            match=rf"worker 1 did not send ResetEpochResponse within 0\.3 s and used no CPU time; it is "
            rf"alive \(pid {process.pid}\) but stuck \(raise control_timeout_s, in seconds, if it needs "
            r"longer\)",
        ):
            channel.recv(0.3, "ResetEpochResponse", option="control_timeout_s", while_busy=True)
        assert time.monotonic() - start < 5

    def test_a_dead_worker_is_reported_with_pid_and_exit_code(self) -> None:
        channel, process = _start(_exit_with, 3)
        start = time.monotonic()
        with pytest.raises(
            WorkerDiedError, match=rf"worker 1 \(pid {process.pid}\) exited unexpectedly with exit code 3"
        ):
            channel.recv()  # no timeout: liveness alone must end the wait
        assert time.monotonic() - start < 10

    def test_a_killed_worker_is_reported_with_the_signal(self) -> None:
        channel, process = _start(_sleep_forever)
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"exit code -9 \(SIGKILL\)"):
            channel.recv()
        process.join(5)

    def test_sending_to_a_dead_worker_names_it(self) -> None:
        channel, process = _start(_exit_with, 0)
        process.join(10)
        with pytest.raises(WorkerDiedError, match=r"worker 1 .* exit code 0"):
            for _ in range(1000):  # the first writes may still fit in the pipe buffer
                channel.send(b"x" * 4096)

    def test_watch_reports_the_process_a_wait_depends_on(self) -> None:
        channel, _endpoint, _ = make_pipe_pair()

        def dispatcher_died() -> None:
            raise WorkerDiedError(
                "dispatching process (pid 42) exited unexpectedly with exit code -9 (SIGKILL)"
            )

        channel.bind("worker 0", watch=dispatcher_died)
        with pytest.raises(WorkerDiedError, match="dispatching process"):
            channel.recv(timeout_s=5)

    def test_the_serving_side_notices_its_parent_is_gone(self) -> None:
        channel, endpoint, _ = make_pipe_pair()
        channel.close()
        with pytest.raises(ParentGone):
            endpoint.recv(timeout_s=1)
        channel2, endpoint2, _ = make_pipe_pair()
        endpoint2.parent = ParentWatch(-1)  # not our parent: as if the parent had died and we were adopted
        with pytest.raises(ParentGone):
            endpoint2.recv(timeout_s=0.01)
        channel2.close()

    @parametrize(
        "code, words",
        [
            (None, "no exit code yet"),
            (0, "exit code 0"),
            (1, "exit code 1"),
            (-15, "exit code -15 (SIGTERM)"),
        ],
        name_fn=lambda code, words: re.sub(r"\W+", "_", words).strip("_"),
    )
    def test_describe_exit(self, code: Optional[int], words: str) -> None:
        assert describe_exit(code) == words


instantiate_parametrized_tests(TestChannel)


if __name__ == "__main__":
    unittest.main()
