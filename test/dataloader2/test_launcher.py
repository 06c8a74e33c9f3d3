"""Starting and stopping a reading service's processes: each worker runs the worker loop on its
shard of the replicable branch behind a channel named for it; a worker that died is started
again in its place; stopping joins the healthy ones and kills the others, within a bound."""

import os
import signal
import time
import unittest
from typing import Any

import torch.multiprocessing as mp
from pipelines import CONTEXT, gone
from torch.testing._internal.common_utils import TestCase
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._errors import WorkerDiedError
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.main.launcher import ProcessLauncher
from torchdata_snapshot.core.options import RestoreOptions, WorkerOptions
from torchdata_snapshot.core.transport.channel import Channel
from torchdata_snapshot.core.transport.item_codec import ItemDecoder

TIMEOUT_S = 60.0


def first_items(channel: Channel, epoch: int, count: int) -> Any:
    """Reset the worker behind ``channel`` to ``epoch``, ask for ``count`` items, read them."""
    channel.send(m.ResetEpochRequest(SeedGenerator(0), None, epoch=epoch))
    assert isinstance(channel.recv(TIMEOUT_S), m.ResetEpochResponse)
    channel.send(m.GetNextRequest(epoch, count))
    got: list = []
    while len(got) < count:
        response = channel.recv(TIMEOUT_S)
        assert isinstance(response, m.ItemsResponse), response
        got.extend(ItemDecoder.decode(response.count, response.payload))
    return got


class TestProcessLauncher(TestCase):
    def launched(self, num_workers: int = 2) -> ProcessLauncher:
        # (Whatever worker loop is installed: one that captures no graph states sends items only.)
        options = WorkerOptions(restore=RestoreOptions(stateful=False))
        launcher = ProcessLauncher(mp.get_context(CONTEXT), num_workers, options)
        self.stopped = False

        def stop() -> None:
            if not self.stopped:
                launcher.stop(0.0)

        self.addCleanup(stop)
        return launcher

    def stop(self, launcher: ProcessLauncher, wait_s: float) -> None:
        self.stopped = True
        launcher.stop(wait_s)

    def test_each_worker_runs_its_shard_behind_a_channel_named_for_it(self) -> None:
        launcher = self.launched()
        channels = launcher.start_workers(IterableWrapper(range(10)).sharding_filter(), [None, None])
        self.assertEqual([channel.name for channel in channels], ["worker 0", "worker 1"])
        self.assertEqual([first_items(channel, 0, 3) for channel in channels], [[0, 2, 4], [1, 3, 5]])
        for channel in channels:
            channel.send(m.TerminateRequest())
            self.assertEqual(channel.recv(TIMEOUT_S), m.TerminateResponse())
        pids = [channel.pid for channel in channels]
        start = time.monotonic()
        self.stop(launcher, TIMEOUT_S)
        self.assertLess(time.monotonic() - start, TIMEOUT_S / 2, "they exit once they said goodbye")
        self.assertTrue(gone(pids))

    def test_a_dead_worker_is_started_again_in_its_place(self) -> None:
        launcher = self.launched(num_workers=1)
        (channel,) = launcher.start_workers(IterableWrapper(range(10)).sharding_filter(), [None])
        first_items(channel, 0, 1)
        os.kill(channel.pid, signal.SIGKILL)
        with self.assertRaisesRegex(WorkerDiedError, "worker 0"):
            channel.recv(TIMEOUT_S)
        fresh = launcher.restart_worker(0)
        self.assertNotEqual(fresh.pid, channel.pid)
        self.assertEqual(first_items(fresh, 0, 4), [0, 1, 2, 3])

    def test_stopping_kills_what_does_not_exit_within_the_bound(self) -> None:
        launcher = self.launched()
        channels = launcher.start_workers(IterableWrapper(range(10)).sharding_filter(), [None, None])
        pids = [channel.pid for channel in channels]
        start = time.monotonic()
        self.stop(launcher, 0.5)  # nobody asked them to terminate: they wait for requests
        self.assertLess(time.monotonic() - start, TIMEOUT_S / 2)
        self.assertTrue(gone(pids), "killed once the bound passed")


if __name__ == "__main__":
    unittest.main()
