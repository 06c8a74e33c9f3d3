"""TensorPool: an item's tensors cross in one slot, unchanged, and the slot is free again once
the item is dropped unsent or its last tensor is freed, in the process it was lent to only."""

from __future__ import annotations

import gc
import io
import os

import pytest
import torch

from torchdata_snapshot._item_codec import ItemDecoder, ItemEncoder
from torchdata_snapshot._tensor_pool import TensorPool, TensorPoolOptions


def test_an_item_dropped_unsent_frees_its_slot() -> None:
    pool = TensorPool(TensorPoolOptions(2, 1 << 16))
    encoder = ItemEncoder(pool)
    encoder.dumps((torch.ones(4), torch.zeros(3, dtype=torch.int32)))  # both in one slot
    assert encoder.slot == 0 and pool.free_slots() == 1
    pool.release(encoder.slot)
    assert pool.free_slots() == 2


def test_the_main_process_frees_a_slot_when_its_last_view_dies() -> None:
    pool = TensorPool(TensorPoolOptions(2, 1 << 16))
    encoder = ItemEncoder(pool)
    payload = encoder.dumps({"a": torch.arange(5), "b": torch.ones(2, 2)})
    (item,) = ItemDecoder.decode(1, payload, pool)
    assert torch.equal(item["a"], torch.arange(5)) and torch.equal(item["b"], torch.ones(2, 2))
    a = item["a"]
    del item
    assert pool.free_slots() == 1  # a still views it
    del a
    assert pool.free_slots() == 2


def test_a_pooled_tensor_saves_as_its_own_bytes_not_its_slot() -> None:
    """A tensor's storage is what it holds: ``torch.save`` of a small tensor the user keeps
    writes that tensor, not the whole slot it arrived in."""
    pool = TensorPool(TensorPoolOptions(1, 1 << 20))
    (item,) = ItemDecoder.decode(1, ItemEncoder(pool).dumps((torch.arange(3), torch.ones(2))), pool)
    for tensor in item:
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    saved = io.BytesIO()
    torch.save(item, saved)
    assert saved.tell() < 4096 and all(map(torch.equal, torch.load(io.BytesIO(saved.getvalue())), item))
    assert pool.free_slots() == 0
    del item, tensor
    assert pool.free_slots() == 1


@pytest.mark.parametrize(
    "tensor",
    [
        torch.ones(3, dtype=torch.bool),
        torch.arange(6.0).view(2, 3).to(torch.complex64),
        torch.tensor(3.5),
        torch.arange(4, dtype=torch.bfloat16),  # numpy has no bfloat16
        torch.arange(6, dtype=torch.float16).view(3, 2),
    ],
)
def test_every_dtype_and_shape_crosses_unchanged(tensor: torch.Tensor) -> None:
    pool = TensorPool(TensorPoolOptions(1, 1 << 16))
    encoder = ItemEncoder(pool)
    (got,) = ItemDecoder.decode(1, encoder.dumps(tensor), pool)
    assert encoder.slot == 0 and got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_forked_process_that_collects_an_inherited_tensor_frees_nothing() -> None:
    pool = TensorPool(TensorPoolOptions(2, 1 << 16))
    (kept,) = ItemDecoder.decode(1, ItemEncoder(pool).dumps(torch.arange(5)), pool)
    pid = os.fork()
    if pid == 0:  # a worker forked later inherits the user's tensors and their finalizers
        del kept
        gc.collect()
        os._exit(pool.free_slots())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1  # the child's collection freed nothing
    assert pool.free_slots() == 1 and torch.equal(kept, torch.arange(5))
