"""Capture pacing: a restore replays at most about 100 captures' time (one item when an item costs
more), from the first item on, whatever an item costs; waits for credit are not production, and
a first capture's one-time cost does not space the rest."""

from __future__ import annotations

import unittest
from typing import List
from unittest import TestCase

from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot.graph_state.capture import CapturePacer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def produce(
    pacer: CapturePacer, clock: FakeClock, items: int, item_s: float, capture_s: float, first_s: float = 0.0
) -> List[int]:
    """Produce ``items`` items of ``item_s`` each, capturing when due (the first capture costing
    ``first_s`` if given); the positions captured at."""
    captured: List[int] = []
    for produced in range(1, items + 1):
        pacer.start_producing()
        clock.now += item_s
        if pacer.due(produced):
            cost = first_s if first_s and not captured else capture_s
            clock.now += cost
            pacer.captured(produced, cost)
            captured.append(produced)
        pacer.stop_producing()
    return captured


class TestCapture(TestCase):
    def test_the_first_two_captures_follow_the_first_two_items(self) -> None:
        clock = FakeClock()
        pacer = CapturePacer(max_items_between_captures=1024, clock=clock)
        assert produce(pacer, clock, 2, item_s=1e-6, capture_s=1e-3) == [1, 2]

    def test_a_dear_first_capture_does_not_space_the_rest(self) -> None:
        """The first capture of an epoch pays for one-time work (cold caches and code paths): paced by
        its 1 ms, the next one would come 100 items of 1 ms later, and a restore before it would
        replay up to 100 ms; the second capture's 67 us paces the rest, 6 items apart."""
        clock = FakeClock()
        pacer = CapturePacer(max_items_between_captures=1024, clock=clock)
        assert produce(pacer, clock, 20, item_s=1e-3, capture_s=67e-6, first_s=1e-3) == [1, 2, 8, 14, 20]

    @parametrize(
        "item_s, capture_s, spacing",
        [
            (1e-3, 67e-6, 6),  # 1 ms items: 6.7 items' worth of 1% -> every 6 items, never 7
            (20e-3, 300e-6, 1),  # slow items: 1.5 -> every item, so a restore replays one item
            (20e-3, 100e-6, 1),  # a capture cheaper than 1% of an item: every item
            (20e-3, 5.1e-3, 25),  # a dear capture (a large buffer): 24 items replayed, 480 ms <= 510
            (1e-6, 67e-6, 1024),  # tiny items: max_items_between_captures bounds the count
        ],
    )
    def test_captures_are_spaced_so_that_the_replay_between_two_takes_at_most_100_captures(
        self, item_s: float, capture_s: float, spacing: int
    ) -> None:
        clock = FakeClock()
        pacer = CapturePacer(max_items_between_captures=1024, clock=clock)
        captured = produce(pacer, clock, 2 + 3 * spacing, item_s, capture_s)
        assert captured == [1] + [2 + i * spacing for i in range(4)]
        replay_s = (spacing - 1) * item_s  # a restore right before the next capture
        assert replay_s <= max(item_s, 100 * capture_s)

    def test_waiting_for_credit_is_not_production(self) -> None:
        """A worker far ahead of a slow training step waits between items: had the waits counted as
        production, items would look 1,000 times dearer and every item would be captured."""
        clock = FakeClock()
        pacer = CapturePacer(max_items_between_captures=1024, clock=clock)
        captured = []
        for produced in range(1, 21):
            clock.now += 1.0  # waiting for credit, outside production
            pacer.start_producing()
            clock.now += 1e-3
            if pacer.due(produced):
                pacer.captured(produced, 50e-6)
                captured.append(produced)
            pacer.stop_producing()
        assert captured == [1, 2, 7, 12, 17]

    def test_replayed_items_do_not_pace_captures(self) -> None:
        """After a restore replayed 100 items in no measured production time, the next captures are
        paced by the items produced since, not by an average over the replayed ones: the first two
        follow the first two items produced, as at an epoch's start."""
        clock = FakeClock()
        pacer = CapturePacer(max_items_between_captures=1024, clock=clock)
        pacer.start_producing()
        pacer.replayed(100)
        for produced in (101, 102):
            clock.now += 1e-3
            assert pacer.due(produced)
            pacer.captured(produced, 50e-6)
        pacer.stop_producing()
        assert pacer.next_capture == 107


instantiate_parametrized_tests(TestCapture)


if __name__ == "__main__":
    unittest.main()
