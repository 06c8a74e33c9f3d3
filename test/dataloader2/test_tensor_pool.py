"""TensorPool: an item's tensors cross in one slot, unchanged, and the slot is free again once
the item is dropped unsent or its last tensor is freed, in the process it was lent to only, and
once every process forked while the tensor lived has exited."""

from __future__ import annotations

import gc
import io
import mmap
import os
import pickle
import unittest
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from pipelines import ForkReader
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

from torchdata_snapshot.core.options import TensorPoolOptions
from torchdata_snapshot.core.transport.item_codec import ItemDecoder, ItemEncoder
from torchdata_snapshot.tensor_pool.pool import TensorPool

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")

#: The pool needs Linux's os.memfd_create (torchdata's CI runs this suite on macOS and Windows too).
pytestmark = pytest.mark.skipif(TensorPool.unavailable() is not None, reason=str(TensorPool.unavailable()))


def as_the_usual_path_gives_it(obj: Any) -> Any:
    """``obj`` through the channel without a pool: pickled as the workers pickle their items."""
    (got,) = ItemDecoder.decode(1, ItemEncoder().dumps(obj), None)
    return got


def memfd_bytes(pool: TensorPool) -> int:
    """The memory the pool's memfd holds (it is sparse: the pages written)."""
    assert pool.fd is not None
    return os.fstat(pool.fd).st_blocks * 512


class Labelled(torch.Tensor):
    """A tensor subclass: it crosses as itself, not as a view of a slot."""


#: Tensors a slot cannot hold as a view, by kind.
UNQUALIFIED = {
    "nested": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)]),  # strided, yet nested
    "sparse": lambda: torch.eye(3).to_sparse(),
    "transposed": lambda: torch.arange(6.0).view(2, 3).t(),  # not contiguous
    "subclass": lambda: torch.zeros(3).as_subclass(Labelled),
}


def values(tensor: torch.Tensor) -> Any:
    return [t.tolist() for t in tensor.unbind()] if tensor.is_nested else tensor.to_dense().tolist()


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def pooled_item(pool: TensorPool, encoder: ItemEncoder, value: int) -> torch.Tensor:
    (tensor,) = ItemDecoder.decode(1, encoder.dumps(torch.full((16,), value)), pool)
    return tensor


class TestTensorPool(SuiteTestCase):
    def test_an_item_dropped_unsent_frees_its_slot(self) -> None:
        pool = TensorPool(TensorPoolOptions(2, 1 << 16))
        encoder = ItemEncoder(pool)
        encoder.dumps((torch.ones(4), torch.zeros(3, dtype=torch.int32)))  # both in one slot
        assert encoder.slot == 0 and pool.free_slots() == 1
        pool.release(encoder.slot)
        assert pool.free_slots() == 2

    def test_the_main_process_frees_a_slot_when_its_last_view_dies(self) -> None:
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

    def test_a_pooled_tensor_saves_as_its_own_bytes_not_its_slot(self) -> None:
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

    @parametrize(
        "tensor",
        [
            torch.ones(3, dtype=torch.bool),
            torch.arange(6.0).view(2, 3).to(torch.complex64),
            torch.tensor(3.5),
            torch.arange(4, dtype=torch.bfloat16),  # numpy has no bfloat16
            torch.arange(6, dtype=torch.float16).view(3, 2),
        ],
    )
    def test_every_dtype_and_shape_crosses_unchanged(self, tensor: torch.Tensor) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 16))
        encoder = ItemEncoder(pool)
        (got,) = ItemDecoder.decode(1, encoder.dumps(tensor), pool)
        assert encoder.slot == 0 and got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor)

    @needs_fork
    def test_a_forked_process_that_collects_an_inherited_tensor_frees_nothing(self) -> None:
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

    def test_trimmed_a_kept_tensor_holds_its_own_pages_not_its_pool(self) -> None:
        pool = TensorPool(TensorPoolOptions(4, 1 << 20, 1 << 20))
        encoder = ItemEncoder(pool)
        kept = []
        for i in range(4):  # every slot written: ~4 x 512 KiB
            item = {"image": torch.full((1 << 19,), i, dtype=torch.uint8), "label": torch.tensor([i])}
            (got,) = ItemDecoder.decode(1, encoder.dumps(item), pool)
            kept.append(got["label"])  # the image is dropped, its label kept
        del got, item
        dropped = ItemDecoder.decode(
            1, encoder.dumps(np.ones(1 << 17)), pool
        )  # (a slot left leased, then freed)
        del dropped
        before = memfd_bytes(pool)
        assert before >= 4 * (1 << 19)
        given = pool.trim()
        after = memfd_bytes(pool)
        page = mmap.PAGESIZE
        assert after <= 4 * page + pool._header, "a page per kept label, and the slots' flags"
        assert given >= before - after
        assert [int(label) for label in kept] == [0, 1, 2, 3], "the kept tensors' values stay"

    def test_trim_keeps_what_every_live_view_of_an_item_reads(self) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 20, 1 << 20))
        item = {"a": torch.arange(1 << 16, dtype=torch.int32), "b": torch.arange(1 << 16, dtype=torch.int64)}
        (got,) = ItemDecoder.decode(1, ItemEncoder(pool).dumps(item), pool)
        part = got["a"][100:200]  # a view outlives its tensor
        array = got["b"].numpy()[::7]  # an array outlives its tensor
        del got
        pool.trim()
        assert torch.equal(part, torch.arange(100, 200, dtype=torch.int32))
        assert np.array_equal(array, np.arange(1 << 16)[::7])

    def test_trim_keeps_a_slot_a_fork_may_read(self) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 20, 1 << 20))
        (got,) = ItemDecoder.decode(1, ItemEncoder(pool).dumps(torch.ones(1 << 17)), pool)
        pool._ledger.holds[0] += 1  # as a fork made while it was leased holds it
        try:
            del got
            before = memfd_bytes(pool)
            assert pool.trim() == 0 and memfd_bytes(pool) == before
        finally:
            pool._ledger.holds[0] -= 1

    @parametrize(
        "array",
        [
            np.arange(12, dtype=np.float32).reshape(3, 4),
            np.array([True, False, True]),
            np.array(7, dtype=np.int16),  # 0-d
            np.arange(3, dtype=">i4"),  # big-endian
            np.array(["2026-12-02", "1970-01-01"], dtype="datetime64[D]"),  # no buffer protocol
            np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "i1"), ("b", "f8")]),  # structured
            np.frombuffer(b"abcdef", dtype="S3"),
        ],
    )
    def test_numpy_arrays_cross_in_the_slot_unchanged(self, array: np.ndarray) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 16))
        encoder = ItemEncoder(pool)
        (got,) = ItemDecoder.decode(1, encoder.dumps({"x": array}), pool)
        assert encoder.slot == 0 and encoder.shared  # the payload holds a slot reference, not the bytes
        assert (
            type(got["x"]) is np.ndarray and got["x"].dtype == array.dtype and got["x"].shape == array.shape
        )
        assert np.array_equal(got["x"], array)
        assert got["x"].flags.writeable == as_the_usual_path_gives_it(array).flags.writeable
        kept = got.pop("x")
        del got
        gc.collect()
        assert pool.free_slots() == 0  # the array the user keeps holds its slot
        del kept
        assert pool.free_slots() == 1

    def test_an_array_and_a_tensor_share_a_slot_until_both_are_freed(self) -> None:
        pool = TensorPool(TensorPoolOptions(2, 1 << 16))
        (item,) = ItemDecoder.decode(1, ItemEncoder(pool).dumps((np.arange(4), torch.arange(4))), pool)
        array, tensor = item
        del item
        assert pool.free_slots() == 1
        saved = io.BytesIO()
        torch.save(array, saved, pickle_protocol=4)  # a kept array pickles as its own bytes
        assert saved.tell() < 4096
        del array
        assert pool.free_slots() == 1  # the tensor still holds the slot
        del tensor
        assert pool.free_slots() == 2

    @parametrize(
        "array",
        [
            np.array([{"k": 1}, None], dtype=object),  # Python objects
            np.arange(12).reshape(3, 4)[:, ::2],  # not contiguous
            np.ma.masked_array([1, 2, 3]),  # a subclass
            np.zeros(0),  # empty
        ],
    )
    def test_arrays_that_do_not_qualify_take_the_usual_path(self, array: np.ndarray) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 16))
        encoder = ItemEncoder(pool)
        (got,) = ItemDecoder.decode(1, encoder.dumps(array), pool)
        assert encoder.slot is None and pool.free_slots() == 1
        assert type(got) is type(array) and got.shape == array.shape
        assert list(got.ravel()) == list(array.ravel())

    @parametrize("kind", sorted(UNQUALIFIED))
    def test_tensors_that_do_not_qualify_take_the_usual_path(self, kind: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
            tensor = UNQUALIFIED[kind]()
        pool = TensorPool(TensorPoolOptions(1, 1 << 16))
        encoder = ItemEncoder(pool)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's first sparse rebuild warns once
            (got,) = ItemDecoder.decode(1, encoder.dumps(tensor), pool)
        assert encoder.slot is None and pool.free_slots() == 1
        assert type(got) is type(tensor) and got.layout == tensor.layout and got.is_nested == tensor.is_nested
        assert values(got) == values(tensor)

    @parametrize(
        "array",
        [
            read_only(np.arange(6.0)),
            np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),  # a decoder's view of bytes
            read_only(np.zeros((2, 3), dtype=np.int16)),
            np.arange(4),  # writeable stays writeable
        ],
    )
    def test_an_array_has_the_flags_multiprocessing_queues_give_it(self, array: np.ndarray) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 16))
        encoder = ItemEncoder(pool)
        (got,) = ItemDecoder.decode(1, encoder.dumps(array), pool)
        assert encoder.slot == 0 and np.array_equal(got, array)
        through_a_queue = pickle.loads(
            ForkingPickler.dumps(array)
        )  # what the queue-based loop's workers send
        assert got.flags.writeable == as_the_usual_path_gives_it(array).flags.writeable
        assert got.flags.writeable == through_a_queue.flags.writeable
        assert got.strides == as_the_usual_path_gives_it(array).strides

    @parametrize(
        "tensor",
        [
            torch.arange(3.0).as_strided((3, 1), (1, 5)),  # contiguous: the size-1 dimension's stride is free
            torch.arange(6).as_strided((1, 2, 3), (99, 3, 1)),
            torch.arange(6).view(1, 6),  # the usual strides
        ],
    )
    def test_a_tensor_keeps_its_strides_as_pickle_does(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()
        pool = TensorPool(TensorPoolOptions(1, 1 << 16))
        encoder = ItemEncoder(pool)
        (got,) = ItemDecoder.decode(1, encoder.dumps(tensor), pool)
        assert encoder.slot == 0 and torch.equal(got, tensor)
        assert got.stride() == as_the_usual_path_gives_it(tensor).stride() == tensor.stride()

    @needs_fork
    def test_a_process_forked_while_a_tensor_lives_reads_its_values_after_the_parent_drops_it(self) -> None:
        pool = TensorPool(TensorPoolOptions(2, 1 << 16))
        encoder = ItemEncoder(pool)
        tensor = pooled_item(pool, encoder, 3)
        child = ForkReader(tensor)  # an asynchronous checkpoint writer, say
        del tensor
        try:
            for _ in range(3):  # later items: none goes into the slot the child reads
                assert int(pooled_item(pool, encoder, 41)[0]) == 41
            assert encoder.slot == 1 and pool.free_slots() == 1 and pool.slots_held_for_forks == 1
        finally:
            seen = child.read()
        assert seen == (3, 3 * 16)
        pool.reclaim()  # the child has exited: its slot is the worker's again
        assert pool.free_slots() == 2 and pool.slots_held_for_forks == 0

    @needs_fork
    def test_forked_processes_holding_every_slot_send_items_the_usual_way(self) -> None:
        pool = TensorPool(TensorPoolOptions(2, 1 << 16))
        encoder = ItemEncoder(pool)
        held = [pooled_item(pool, encoder, 3), pooled_item(pool, encoder, 5)]
        children = [ForkReader(held[0]), ForkReader(held[1])]
        del held
        try:
            assert pool.free_slots() == 0 and pool.slots_held_for_forks == 2
            later = pooled_item(pool, encoder, 41)
            assert encoder.slot is None and later.is_shared() and int(later[0]) == 41  # no wait, no error
        finally:
            seen = [child.read() for child in children]
        assert seen == [(3, 48), (5, 80)]
        pool.reclaim()
        assert pool.free_slots() == 2
        assert int(pooled_item(pool, encoder, 7)[0]) == 7 and encoder.slot == 0  # the pool again

    def test_an_item_too_big_for_its_slot_goes_the_usual_way_and_grows_the_slots_for_later_items(
        self,
    ) -> None:
        pool = TensorPool(TensorPoolOptions(2, 4 << 20, slot_bytes=1 << 16))
        encoder = ItemEncoder(pool)
        big = torch.arange(40_000, dtype=torch.int64)  # 320 KB: more than the slot's 64 KiB
        (first,) = ItemDecoder.decode(1, encoder.dumps(big), pool)
        assert encoder.slot is None and first.is_shared() and torch.equal(first, big)  # the usual path
        assert pool.slot_bytes == -(-320_000 // mmap.PAGESIZE) * mmap.PAGESIZE  # what it needed, in pages
        (second,) = ItemDecoder.decode(1, encoder.dumps(big + 1), pool)
        assert encoder.slot == 0 and not second.is_shared() and torch.equal(second, big + 1)
        assert torch.equal(first, big)  # the first is its own memory

    def test_the_slots_grow_at_least_twofold_and_never_past_their_bound(self) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 20, slot_bytes=1 << 16))
        encoder = ItemEncoder(pool)
        encoder.dumps(torch.zeros(70_000, dtype=torch.uint8))  # a little over 64 KiB
        assert encoder.slot is None and pool.slot_bytes == 1 << 17  # twice the slot
        encoder.dumps(torch.zeros(2 << 20, dtype=torch.uint8))  # 2 MiB: past the bound
        assert encoder.slot is None and pool.slot_bytes == 1 << 20  # grown to the bound, no further
        (item,) = ItemDecoder.decode(1, encoder.dumps(torch.full((2 << 20,), 3, dtype=torch.uint8)), pool)
        assert encoder.slot is None and item.is_shared() and int(item.sum()) == 3 * (2 << 20)
        del item
        (fits,) = ItemDecoder.decode(1, encoder.dumps(torch.full((1 << 20,), 5, dtype=torch.uint8)), pool)
        assert encoder.slot == 0 and int(fits.sum()) == 5 << 20  # exactly the bound: in the slot

    def test_the_tensors_of_an_item_that_fit_go_in_its_slot_and_the_rest_grows_it(self) -> None:
        pool = TensorPool(TensorPoolOptions(1, 1 << 20, slot_bytes=1 << 16))
        encoder = ItemEncoder(pool)
        item = (torch.ones(8000, dtype=torch.int64), torch.zeros(8000, dtype=torch.int64))  # 2 x 64,000 B
        (got,) = ItemDecoder.decode(1, encoder.dumps(item), pool)
        assert encoder.slot == 0 and not got[0].is_shared() and got[1].is_shared()
        assert all(map(torch.equal, got, item)) and pool.slot_bytes == 1 << 17
        del got
        (again,) = ItemDecoder.decode(1, encoder.dumps(item), pool)
        assert not any(t.is_shared() for t in again) and all(map(torch.equal, again, item))

    def test_a_pool_uses_the_memory_of_the_items_seen_not_its_bound(self) -> None:
        pool = TensorPool(TensorPoolOptions(4, 64 << 20))
        assert pool.options.max_bytes == 256 << 20
        encoder = ItemEncoder(pool)
        (item,) = ItemDecoder.decode(1, encoder.dumps(torch.ones(1024)), pool)
        assert os.fstat(pool.fd).st_blocks * 512 <= 64 << 10  # sparse: a page or so, not 256 MiB
        del item
        pool.close_fd()

    def test_the_platform_is_named_where_it_has_no_pool(self) -> None:
        assert TensorPool.unavailable() is None  # the suite runs on Linux
        self.monkeypatch.setattr("sys.platform", "darwin")
        assert TensorPool.unavailable() == (
            "the tensor pool needs Linux (os.memfd_create), and this platform is darwin"
        )


instantiate_parametrized_tests(TestTensorPool)


if __name__ == "__main__":
    unittest.main()
