"""Item codec: items pickled one by one, independent of each other, shared memory noted."""

import unittest
from unittest import TestCase

import pytest
import torch

from torchdata_snapshot.core.transport.item_codec import ItemDecoder, ItemEncoder


class TestItemCodec(TestCase):
    def test_encoder_round_trips_items_in_order(self) -> None:
        items = [0, "a", {"k": [1, 2]}, None, (3.5, b"x"), torch.arange(4)]
        encoder = ItemEncoder()
        for item in items:
            encoder.add(item)
        assert encoder.count == len(items) and encoder.nbytes > 0
        count, payload = encoder.take()
        decoded = ItemDecoder.decode(count, payload)
        assert decoded[:-1] == items[:-1]
        assert torch.equal(decoded[-1], items[-1])
        assert encoder.count == 0 and encoder.nbytes == 0

    def test_encoder_keeps_items_independent(self) -> None:
        shared = [1, 2]
        encoder = ItemEncoder()
        encoder.add(shared)
        encoder.add(shared)
        first, second = ItemDecoder.decode(*encoder.take())
        assert first == second == [1, 2] and first is not second

    def test_the_encoder_tells_items_holding_shared_memory_apart(self) -> None:
        """A tensor travels through shared memory: its pickle is a handle, not its size."""
        import numpy as np

        encoder = ItemEncoder()
        for item, shared in [
            (torch.zeros(1000), True),
            ({"image": torch.zeros(3, 8, 8), "label": 1}, True),
            (0, False),  # the flag is the last item's, not the batch's
            ("a" * 1000, False),
            ({"k": [1, 2.5, (b"x", None)]}, False),
            (np.zeros(1000), False),  # numpy arrays are copied into the pickle
        ]:
            payload = encoder.dumps(item)
            assert encoder.shared is shared, item
            assert type(ItemDecoder.decode(1, payload)[0]) is type(item)

    def test_plain_items_skip_the_sharing_pickler_and_pickle_to_the_same_bytes(self) -> None:
        """Numbers, strings, bytes, booleans and None hold nothing to share: pickled directly, as
        the sharing pickler pickles them, whatever the item before them held."""
        plain = [0, -1, 2**70, 1.5, float("inf"), "", "\u00fc" * 300, b"x" * 70000, True, None]
        through_the_pickler = []
        for item in plain:
            encoder = ItemEncoder()
            encoder.add(item)
            through_the_pickler.append(encoder.take()[1])
        encoder = ItemEncoder()
        encoder.dumps(torch.zeros(3))  # (a tensor: shared)
        encoder._pickler.dump = None  # type: ignore[assignment,method-assign]  # never called
        for item, expected in zip(plain, through_the_pickler):
            assert encoder.dumps(item) == expected, item
            assert not encoder.shared and encoder.slot is None

    def test_a_failed_item_leaves_the_batch_as_it_was(self) -> None:
        encoder = ItemEncoder()
        encoder.add(1)
        with pytest.raises(AttributeError, match="Can't (pickle|get) local object"):
            encoder.add(lambda: None)  # not picklable
        encoder.add(2)
        assert ItemDecoder.decode(*encoder.take()) == [1, 2]


if __name__ == "__main__":
    unittest.main()
