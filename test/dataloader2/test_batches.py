"""Batches of a stream: messages of queued items, and the credit window, which grows for small
items that travel whole in their pickles and never for items holding shared memory."""

from __future__ import annotations

import pickle
import unittest

from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot._constants import SMALL_ITEMS_MAX_WINDOW
from torchdata_snapshot.core.transport.batches import Credit, QueuedItem, items_message, small_items_window

BUDGET = 1 << 18


class TestBatches(SuiteTestCase):
    def test_a_message_counts_the_items_holding_shared_memory(self) -> None:
        batch = [QueuedItem(1, pickle.dumps(i), None, shared=i % 2 == 0) for i in range(5)]
        message = items_message(batch)
        assert (message.epoch, message.count, message.shared) == (1, 5, 3)

    def test_a_message_names_the_items_whose_production_opened_files(self) -> None:
        batch = [QueuedItem(1, pickle.dumps(i), opened=b"f%d" % i if i in (1, 4) else None) for i in range(5)]
        assert items_message(batch).opened == ((1, b"f1"), (4, b"f4"))

    @parametrize(
        "item_bytes, shared, window",
        [
            (5, False, SMALL_ITEMS_MAX_WINDOW),  # ints: as many as allowed
            (2048, False, BUDGET // 2048),  # 2 KB strings: 128, the budget's worth
            (100_000, False, 21),  # large pickles: the prefetch counts
            (5, True, 21),  # tensors were among them: their size is unknown
        ],
    )
    def test_the_window_grows_for_small_items_only(self, item_bytes: int, shared: bool, window: int) -> None:
        assert small_items_window(21, item_bytes, shared, BUDGET) == window

    def test_without_a_budget_the_window_is_the_prefetch_counts(self) -> None:
        assert small_items_window(21, 5, False, 0) == 21

    def test_a_shrunk_window_grants_nothing_until_half_of_it_is_outstanding(self) -> None:
        credit = Credit(512)
        assert credit.top_up(0) == 512
        credit.window = 21  # larger items came
        assert credit.top_up(400) == 0  # 112 outstanding
        assert credit.top_up(502) == 11  # 10 outstanding: topped up to 21


instantiate_parametrized_tests(TestBatches)


if __name__ == "__main__":
    unittest.main()
