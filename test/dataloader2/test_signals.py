"""A reading service's child processes leave SIGTERM and SIGINT to the training process, which ends
them: a job's preemption signal or a Ctrl-C reaches every process of the group at once, and a
worker that died of it first would fail the step the training process is finishing."""

import signal
import subprocess
import sys
import unittest
from unittest import TestCase

import pytest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot.core.worker.signals import ignore_job_signals

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="on Windows os.kill ends a process whatever its handlers"
)


def signalled(ignore: bool, signum: int) -> subprocess.CompletedProcess:
    """A fresh Python that sends itself ``signum`` (after ``ignore_job_signals()`` if ``ignore``).
    It starts from Python's own handling of both signals, whatever the suite inherited (a shell
    starts a background job with SIGINT ignored, and Python then leaves it ignored)."""
    code = (
        "import os, signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        f"from {ignore_job_signals.__module__} import ignore_job_signals\n"
        f"{'ignore_job_signals()' if ignore else 'pass'}\n"
        f"os.kill(os.getpid(), {int(signum)})\n"
        "print('still running')\n"
    )
    command = [sys.executable, "-W", "ignore", "-c", code]  # (torchdata warns that it is deprecated)
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


class TestSignals(TestCase):
    @parametrize(
        "signum", [signal.SIGTERM, signal.SIGINT], name_fn=lambda signum: signal.Signals(signum).name
    )
    def test_a_child_that_ignores_job_signals_outlives_them(self, signum: int) -> None:
        done = signalled(True, signum)
        assert (done.returncode, done.stdout, done.stderr) == (0, "still running\n", "")

    @parametrize(
        "signum", [signal.SIGTERM, signal.SIGINT], name_fn=lambda signum: signal.Signals(signum).name
    )
    def test_without_it_the_same_signal_ends_the_process(self, signum: int) -> None:
        done = signalled(False, signum)
        assert done.stdout == "" and done.returncode != 0, "the signal ends it (SIGINT: KeyboardInterrupt)"


instantiate_parametrized_tests(TestSignals)


if __name__ == "__main__":
    unittest.main()
