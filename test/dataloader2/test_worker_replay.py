"""The worker loop that restores by replay, driven in-process: every item carries its stream's
running digest, and ``ReplayRequest`` drops the items the user had, checked against that digest."""

import unittest
from array import array
from typing import Any, List

import pytest
from suite_case import SuiteTestCase
from torchdata.datapipes.iter import IterableWrapper
from worker_driver import Counting, items_of, reset, serve

from torchdata_snapshot._errors import ProtocolError, ReplayDivergenceError
from torchdata_snapshot.checkpoint import worker_loop
from torchdata_snapshot.checkpoint.digest import CHAIN_START, chain, chain_hex
from torchdata_snapshot.checkpoint.worker_loop import ReplayingWorkerLoop
from torchdata_snapshot.core import messages as m
from torchdata_snapshot.core.options import BatchingOptions


def replaying(datapipe: Any, requests: List[Any], *args: Any, **options: Any) -> List[Any]:
    return serve(datapipe, requests, *args, loop=ReplayingWorkerLoop, **options)


def running_digests(items: List[Any]) -> List[int]:
    out, value = [], CHAIN_START
    for item in items:
        value = chain(value, item)
        out.append(value)
    return out


class TestReplayingWorker(SuiteTestCase):
    def test_a_replay_drops_the_first_items_then_streams_the_rest(self) -> None:
        dp = Counting(IterableWrapper(range(10)))
        responses = replaying(
            dp, [reset(), m.ReplayRequest(0, 4), m.GetNextRequest(0, 3), m.GetStateRequest()]
        )
        assert responses[1] == m.ReplayResponse(0, 4)
        assert items_of(responses) == [4, 5, 6], "the replayed items never leave the worker"
        snap = responses[-1].snapshot
        assert snap.produced == 7 and snap.sent + snap.buffered == 7
        assert dp.pulled == 7

    def test_every_item_carries_the_running_digest_of_its_stream(self) -> None:
        responses = replaying(
            IterableWrapper(range(10)), [reset(), m.GetNextRequest(0, 9)], BatchingOptions(max_items=2)
        )
        batches = [r for r in responses if isinstance(r, m.ItemsResponse)]
        assert [d for b in batches for d in array("Q", b.digests)] == running_digests(list(range(9)))
        off = replaying(IterableWrapper(range(3)), [reset(), m.GetNextRequest(0, 3)], verify_replay=False)
        off_batches = [r for r in off if isinstance(r, m.ItemsResponse)]
        assert off_batches and all(r.digests is None for r in off_batches)

    def test_a_replay_is_checked_against_the_recorded_running_digest(self) -> None:
        recorded = chain_hex(running_digests(list(range(5)))[-1])
        good = replaying(IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 5, recorded)])
        assert good[1] == m.ReplayResponse(0, 5)
        other = chain_hex(running_digests([0, 1, 2, 3, 99])[-1])
        bad = replaying(IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 5, other)])
        assert isinstance(bad[1], m.ErrorResponse)
        with pytest.raises(
            ReplayDivergenceError,
            match=r"worker process 0: items 1\.\.5 of epoch 0 replayed differently .* not deterministic",
        ):
            bad[1].exc.reraise()
        unchecked = replaying(
            IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 5, other)], verify_replay=False
        )
        assert unchecked[1] == m.ReplayResponse(0, 5), "verify_replay=False turns the check off"

    def test_after_a_replay_the_running_digest_goes_on_from_the_replayed_items(self) -> None:
        responses = replaying(
            IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 4), m.GetNextRequest(0, 3)]
        )
        batches = [r for r in responses if isinstance(r, m.ItemsResponse)]
        assert [d for b in batches for d in array("Q", b.digests)] == running_digests(list(range(7)))[4:]

    def test_a_replay_past_the_end_of_the_stream_is_a_divergence(self) -> None:
        responses = replaying(IterableWrapper(range(3)), [reset(), m.ReplayRequest(0, 5)])
        with pytest.raises(
            ReplayDivergenceError, match="ended after 3 items, but the checkpoint says .* received 5"
        ):
            responses[1].exc.reraise()

    def test_a_long_replay_reports_progress(self) -> None:
        self.monkeypatch.setattr(worker_loop, "REPLAY_HEARTBEAT_S", 0.0)
        responses = replaying(IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 3)])
        assert responses[1:] == [m.ReplayProgressResponse(0, i) for i in (1, 2, 3)] + [m.ReplayResponse(0, 3)]

    def test_a_replay_must_follow_a_reset(self) -> None:
        responses = replaying(
            IterableWrapper(range(10)), [reset(), m.GetNextRequest(0, 2), m.ReplayRequest(0, 3)]
        )
        with pytest.raises(ProtocolError, match="a replay must directly follow the reset"):
            responses[-1].exc.reraise()

    def test_every_item_carries_the_sharding_filters_position(self) -> None:
        responses = replaying(
            IterableWrapper(range(10)).sharding_filter(),
            [reset(), m.GetNextRequest(0, 4)],
            BatchingOptions(max_items=2),
        )
        batches = [r for r in responses if isinstance(r, m.ItemsResponse)]
        assert [t for b in batches for t in array("q", b.taken)] == [1, 2, 3, 4]

    def test_a_replay_that_brings_a_captured_state_is_refused(self) -> None:
        responses = replaying(
            IterableWrapper(range(10)), [reset(), m.ReplayRequest(0, 3, state=(2, b"state"))]
        )
        with pytest.raises(ProtocolError, match="cannot load a captured state: it restores by replay only"):
            responses[1].exc.reraise()


if __name__ == "__main__":
    unittest.main()
