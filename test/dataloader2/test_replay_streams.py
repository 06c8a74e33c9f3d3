"""What restores a consumer's streams (the checkpoint's): each worker replays to its position,
the round-robin resumes exactly, and each stream's log knows the running digest at every position
the user may reach. Workers run as threads."""

import unittest
from typing import Any, List, Sequence, Tuple

from running_consumer import Running, round_robin
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain, chain_hex
from torchdata_snapshot.checkpoint.format import WorkerPosition
from torchdata_snapshot.checkpoint.session import replay_streams, stream_positions
from torchdata_snapshot.checkpoint.stream_log import StreamLog
from torchdata_snapshot.checkpoint.worker_loop import ReplayingWorkerLoop
from torchdata_snapshot.core.main.positions import UserPositions


def positions_after(streams: Sequence[Sequence[Any]], k: int) -> Tuple[List[WorkerPosition], int]:
    """Where the round-robin over ``streams`` stands after handing out ``k`` items."""
    order = [worker_id for worker_id, _ in round_robin([[(i, x) for x in s] for i, s in enumerate(streams)])]
    taken = order[:k]
    delivered = [taken.count(i) for i in range(len(streams))]
    next_worker = (taken[-1] + 1) % len(streams) if taken else 0
    return [WorkerPosition(d) for d in delivered], next_worker


class TestReplayStreams(SuiteTestCase):
    def running(self, *args: Any, **kwargs: Any) -> Running:
        """Running streams of replaying workers, with logs, closed after the test."""
        running = Running(*args, loop=ReplayingWorkerLoop, stream_log=StreamLog, **kwargs)
        self.addCleanup(running.close)
        return running

    @parametrize("k", [0, 1, 4, 9, 12, 13])
    def test_a_replayed_restore_continues_the_order_exactly(self, k: int) -> None:  # type: ignore[no-untyped-def]
        streams = [list(range(0, 6)), list(range(100, 102)), list(range(200, 205))]
        expected = round_robin(streams)
        r = self.running([IterableWrapper(s) for s in streams], window=2, max_items=2)
        positions, next_worker = positions_after(streams, k)
        r.epoch += 1
        r.consumer.reset_epoch(r.epoch, [SeedGenerator(0)] * 3, None)
        replay_streams(r.consumer, r.epoch, positions, next_worker)
        r.consumer.start_epoch()
        assert list(r.consumer) == expected[k:]

    def test_the_running_digest_is_known_at_every_position_the_user_may_reach(self) -> None:
        # The user's position stays at 0 (no outlet delivers): nothing may be dropped yet.
        r = self.running([IterableWrapper(range(10))], window=16, max_items=3, positions=UserPositions(1))
        assert list(r.start_epoch()) == list(range(10))
        value = CHAIN_START
        assert stream_positions(r.consumer, [0])[0].digest is None, "nothing received, nothing to check"
        for position in range(1, 11):
            value = chain(value, position - 1)
            assert stream_positions(r.consumer, [position])[0].digest == chain_hex(value)


instantiate_parametrized_tests(TestReplayStreams)


if __name__ == "__main__":
    unittest.main()
