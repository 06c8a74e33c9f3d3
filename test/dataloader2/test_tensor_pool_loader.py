"""``tensor_pool=True`` end to end: tensors reach the user as views of recycled slots, equal to
the in-process run, valid as long as the user keeps them (and as long as a process forked while
they lived does), and nothing leaks on faults."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import unittest
from functools import partial
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, List

import numpy as np
import pytest
import torch
from conftest import start_methods
from faults import restarts_logged
from pipelines import ForkReader, rs, take, tensor_items, worker_pools, worker_processes
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot import WorkerDiedError
from torchdata_snapshot.core.options import TensorPoolOptions
from torchdata_snapshot.tensor_pool import pool as pool_module
from torchdata_snapshot.tensor_pool.pool import TensorPool

SIXTY_FOUR_KB, ONE_MB = 8192, 131072  # int64 elements

#: The pool needs Linux's os.memfd_create (torchdata's CI runs this suite on macOS and Windows too).
pytestmark = pytest.mark.skipif(TensorPool.unavailable() is not None, reason=str(TensorPool.unavailable()))


def pooled(t: torch.Tensor) -> bool:
    """A tensor that came through the pool views a slot; the usual path gives shared memory."""
    return not t.is_shared()


def in_process(n: int, numel: int) -> List[torch.Tensor]:
    dl = DataLoader2(tensor_items(n, numel), reading_service=rs(0))
    dl.seed(0)
    try:
        return list(dl)
    finally:
        dl.shutdown()


def assert_equal(got: List[torch.Tensor], expected: List[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def image_item(i: int) -> dict:
    """A decoded-image-like item: a numpy array and a label."""
    return {"image": np.full((32, 32, 3), i % 251, dtype=np.uint8), "label": i}


def decoded_bytes(i: int) -> Any:
    """A decoder's output: a read-only array viewing the bytes it parsed (``np.frombuffer``)."""
    return np.frombuffer(bytes([i % 256]) * 4096, dtype=np.uint8)


def flags_of(array: Any) -> tuple:
    return (type(array).__name__, array.flags.writeable, array.flags.c_contiguous, array.flags.f_contiguous)


def _from_buffer(root: str, i: int) -> Any:
    return np.frombuffer(bytes([i]) * 64, dtype=np.uint8)  # nanoGPT's token ids, read-only


def _set_read_only(root: str, i: int) -> Any:
    array = np.full(16, i, dtype=np.int64)
    array.setflags(write=False)
    return array


def _strided_view(root: str, i: int) -> Any:
    return np.full(32, i, dtype=np.int32)[::2]


def _read_only_view(root: str, i: int) -> Any:
    array = np.full(32, i, dtype=np.int32)
    array.setflags(write=False)
    return array[4:]


def _fortran(root: str, i: int) -> Any:
    return np.asfortranarray(np.full((4, 3), i, dtype=np.float32))


def _memmap(root: str, i: int) -> Any:
    path = os.path.join(root, f"{i}.bin")
    if not os.path.exists(path):
        np.full(8, i, dtype=np.int16).tofile(path)
    return np.memmap(path, dtype=np.int16, mode="r")


def _memmap_view(root: str, i: int) -> Any:
    return np.asarray(_memmap(root, i))[2:]


#: Ways of making an array: from a buffer, flags set, views, memmaps.
ARRAYS = {
    "frombuffer": _from_buffer,
    "setflags": _set_read_only,
    "strided_view": _strided_view,
    "read_only_view": _read_only_view,
    "fortran": _fortran,
    "memmap": _memmap,
    "memmap_view": _memmap_view,
}


def image_and_label(i: int) -> dict:
    """An 8 MiB image and its label, both tensors: they share a slot."""
    return {"image": torch.full((8 << 20,), i % 251, dtype=torch.uint8), "label": torch.tensor([i])}


def shmem_bytes() -> int:
    """The machine's shared memory in use (memfds included), from /proc/meminfo."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


class TestTensorPoolLoader(SuiteTestCase):
    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    @parametrize("numel", [SIXTY_FOUR_KB, ONE_MB])
    def test_items_equal_the_in_process_run(self, context: str, numel: int) -> None:
        dl = self.make_dl(tensor_items(30, numel), rs(2, multiprocessing_context=context, tensor_pool=True))
        got = [t.clone() if i % 2 else t for i, t in enumerate(dl)]  # some kept, some copied
        assert_equal(got, in_process(30, numel))
        assert any(pooled(t) for t in got[::2])

    def test_a_kept_tensor_stays_valid_and_its_slot_is_not_reused(self) -> None:
        dl = self.make_dl(tensor_items(200), rs(1, tensor_pool=True))
        it = iter(dl)
        kept = next(it)
        assert pooled(kept)
        expected = kept.clone()
        for t in it:  # many more items than slots go by while it is kept
            assert t.data_ptr() != kept.data_ptr()
            assert torch.equal(kept, expected)
        dl.shutdown()
        assert torch.equal(kept, expected)  # valid after shutdown too; unmapped when dropped

    def test_a_user_holding_every_item_does_not_block_the_workers(self) -> None:
        slots = TensorPoolOptions.for_window(21, 4096).slots  # 1 worker: a window of 21
        dl = self.make_dl(tensor_items(3 * slots), rs(1, tensor_pool=True))
        held = list(dl)  # more than the pool's slots: the rest take the usual path
        assert_equal(held, in_process(3 * slots, SIXTY_FOUR_KB))
        assert any(pooled(t) for t in held) and not all(pooled(t) for t in held)
        del held
        again = list(dl)  # slots came back when the tensors were dropped
        assert pooled(again[0])

    def test_tensors_larger_than_a_slot_take_the_usual_path(self) -> None:
        dl = self.make_dl(tensor_items(10, ONE_MB), rs(1, tensor_pool=True, tensor_pool_slot_bytes=64 << 10))
        got = list(dl)
        assert_equal(got, in_process(10, ONE_MB))
        assert not any(pooled(t) for t in got)

    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    def test_a_killed_worker_is_reported_and_leaks_nothing(self, context: str) -> None:
        dl = self.make_dl(tensor_items(400), rs(2, multiprocessing_context=context, tensor_pool=True))
        it = iter(dl)
        held = take(it, 10)
        os.kill(worker_processes(dl)[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="worker 1"):
            for _ in it:
                pass
        assert all(t.shape == (SIXTY_FOUR_KB,) for t in held)

    def test_self_healing_continues_exactly_with_the_pool(self) -> None:
        expected = in_process(200, SIXTY_FOUR_KB)
        dl = self.make_dl(tensor_items(200), rs(2, tensor_pool=True, restart_dead_workers=1))
        it = iter(dl)
        got = take(it, 20)
        os.kill(worker_processes(dl)[0].pid, signal.SIGKILL)
        with restarts_logged():
            got += list(it)
        assert_equal(got, expected)

    def test_shutdown_mid_epoch_leaks_nothing(self) -> None:
        dl = self.make_dl(tensor_items(400, ONE_MB), rs(2, tensor_pool=True))
        it = iter(dl)
        kept = take(it, 5)
        dl.shutdown()
        assert all(pooled(t) for t in kept)

    def test_exact_resume_with_tensor_items(self) -> None:
        expected = in_process(60, SIXTY_FOUR_KB)
        dl = self.make_dl(tensor_items(60), rs(2, tensor_pool=True))
        it = iter(dl)
        head = take(it, 23)
        state = dl.state_dict()
        dl.shutdown()
        again = DataLoader2.from_state(state, rs(2, tensor_pool=True))
        try:
            assert_equal(head + list(again), expected)
        finally:
            again.shutdown()

    def test_numpy_arrays_cross_in_slots_and_resume_exactly(self) -> None:
        def graph() -> Any:
            return IterableWrapper(range(60)).shuffle().sharding_filter().map(image_item)

        reference = self.make_dl(graph(), rs(0))
        reference.seed(3)
        expected = [(item["label"], item["image"].copy()) for item in reference]
        dl = self.make_dl(graph(), rs(2, tensor_pool=True))
        dl.seed(3)
        it = iter(dl)
        head = take(it, 17)
        assert all(item["image"].base is not None for item in head)  # views of a slot, not copies
        again = DataLoader2.from_state(dl.state_dict(), rs(2, tensor_pool=True))
        dl.shutdown()
        try:
            got = [(item["label"], item["image"]) for item in head + list(again)]
        finally:
            again.shutdown()
        assert [label for label, _ in got] == [label for label, _ in expected]
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, expected))

    @parametrize("make", sorted(ARRAYS))
    @parametrize("pool", [False, True])
    def test_arrays_arrive_with_the_flags_multiprocessing_queues_give_them(
        self, pool: bool, make: str
    ) -> None:
        # The queue-based loop's workers send items through multiprocessing's queues (ForkingPickler):
        # whatever way an array was made, it arrives as that pickle gives it back.
        build = ARRAYS[make]
        dl = self.make_dl(
            IterableWrapper(range(6)).sharding_filter().map(partial(build, str(self.tmp_path))),
            rs(2, tensor_pool=pool),
        )
        got = sorted(dl, key=lambda a: int(a.flat[0]))
        expected = [pickle.loads(ForkingPickler.dumps(build(str(self.tmp_path), i))) for i in range(6)]
        assert [flags_of(a) for a in got] == [flags_of(a) for a in expected]
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
        for array in got:
            if array.flags.writeable:
                array += 1  # nanoGPT-style ids, changed in place where the queues allow it

    def test_tensors_kept_past_shutdown_hold_their_own_pages_not_their_pools(self) -> None:
        # A new loader each epoch, one label kept from each (168 MiB of shared memory held before).
        before = shmem_bytes()
        labels = []
        for _ in range(3):
            dl = DataLoader2(
                IterableWrapper(range(16)).sharding_filter().map(image_and_label), reading_service=rs(2)
            )
            labels.append(list(dl)[0]["label"])  # the epoch went through the pools, one label kept
            dl.shutdown()
        grown = shmem_bytes() - before
        assert grown < 16 << 20, f"{grown >> 20} MiB of shared memory held after 3 shutdowns"
        assert [int(label) for label in labels] == [0, 0, 0], "kept, and still their values"
        del labels  # (the pools are unmapped with the last of them)

    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    def test_a_process_forked_with_a_tensor_reads_its_values_after_the_loader_moved_on(
        self, context: str
    ) -> None:
        """An asynchronous checkpoint writer forked with a batch: the training process drops the
        batch and iterates on, and the writer still reads what it was given. The user's fork is
        always ``fork``; ``context`` is the workers' start method."""
        numel = 1024
        dl = self.make_dl(tensor_items(300, numel), rs(1, multiprocessing_context=context, tensor_pool=True))
        it = iter(dl)
        take(it, 3)
        tensor = next(it)
        assert pooled(tensor)
        expected = (int(tensor[0]), int(tensor.sum()))
        writer = ForkReader(tensor)
        del tensor
        try:
            take(it, 150)  # the other slots are reused many times over meanwhile
            (pool,) = worker_pools(dl)
            # Its slot, and those of the items the main process had prefetched when it forked.
            assert pool.slots_held_for_forks >= 1
        finally:
            seen = writer.read()
        assert seen == expected
        take(it, 60)  # the writer has exited: its slot returns as the next items arrive (after
        # those the main process had received already, the prefetch window's at most)
        assert pool.slots_held_for_forks == 0

    def test_the_reading_services_own_forks_hold_no_slot(self) -> None:
        """Workers forked by another loader (or restarted by self-healing) read none of the user's
        tensors: the slots of the tensors the user held meanwhile return as usual."""
        dl = self.make_dl(tensor_items(100), rs(1, multiprocessing_context="fork", tensor_pool=True))
        it = iter(dl)
        kept = next(it)
        assert pooled(kept)
        other = self.make_dl(tensor_items(8), rs(2, multiprocessing_context="fork", tensor_pool=True))
        assert len(list(other)) == 8
        (pool,) = worker_pools(dl)
        free = pool.free_slots()
        del kept
        assert pool.slots_held_for_forks == 0 and pool.free_slots() == free + 1

    def test_the_pool_is_on_by_default_where_the_platform_has_it(self) -> None:
        from torchdata_snapshot import MultiProcessingReadingService

        dl = self.make_dl(tensor_items(20), MultiProcessingReadingService(num_workers=1))
        got = list(dl)
        assert_equal(got, in_process(20, SIXTY_FOUR_KB))
        assert all(pooled(t) for t in got)

    def test_off_the_platform_the_default_takes_the_usual_path_and_asking_raises(self) -> None:
        from torchdata_snapshot import MultiProcessingReadingService

        # As on Windows or macOS: the pool module sees another platform (the rest of the process does not).
        self.monkeypatch.setattr(pool_module, "sys", SimpleNamespace(platform="win32", modules=sys.modules))
        dl = self.make_dl(tensor_items(20), MultiProcessingReadingService(num_workers=1))
        got = list(dl)
        assert_equal(got, in_process(20, SIXTY_FOUR_KB))
        assert not any(pooled(t) for t in got) and worker_pools(dl) == [None]
        with pytest.raises(
            ValueError, match="tensor_pool=True: the tensor pool needs Linux .*platform is win32"
        ):
            MultiProcessingReadingService(num_workers=1, tensor_pool=True)
        MultiProcessingReadingService(num_workers=1, tensor_pool=False)  # off: nothing to refuse

    def test_the_slots_grow_to_the_items_seen(self) -> None:
        """Slots start at 1 MiB: 2 MB items take the usual path until one has grown them."""
        numel = 2 * ONE_MB
        dl = self.make_dl(tensor_items(12, numel), rs(1, tensor_pool=True))
        got = list(dl)
        assert_equal(got, in_process(12, numel))
        assert not pooled(got[0]) and all(pooled(t) for t in got[-4:])
        (pool,) = worker_pools(dl)
        assert pool.options.max_slot_bytes == 64 << 20 and pool.options.max_bytes == pool.slots * (64 << 20)


instantiate_parametrized_tests(TestTensorPoolLoader)


if __name__ == "__main__":
    unittest.main()
