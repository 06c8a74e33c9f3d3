"""DataLoader2's semantics with checkpoints: ``_restore_checkpoint_beginning_of_epoch()`` restarts
the saved epoch, a restore without it resumes mid-epoch, seeded or not; with ``num_workers=0`` the
pipeline's own global RNG states keep the training loop's draws out of the data, and reading
ahead changes neither the data nor the checkpoints."""

from __future__ import annotations

import random
import threading
import unittest
from typing import Any, Callable, List, Tuple

import numpy
import torch
from pipelines import pipeline, rs, take
from suite_case import SuiteTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from torchdata_snapshot._constants import READ_AHEAD_ITEMS
from torchdata_snapshot.checkpoint import outlet as outlet_module

CALLS = [0]  # calls of count_calls


def count_calls(x: int) -> int:
    CALLS[0] += 1
    return x


def with_global_normals(x: int) -> Tuple[Any, ...]:
    """Uses the three global RNGs, an odd number of numpy normals among them."""
    return (
        x,
        random.random(),
        random.gauss(0, 1),
        float(torch.rand(())),
        float(torch.randn(())),
        float(numpy.random.rand()),
        float(numpy.random.normal()),
    )


def training_loop_draws() -> None:
    random.random()
    random.gauss(0, 1)
    torch.randn(3)
    numpy.random.normal()


class OtherThread:
    """A thread of the training process that draws from ``random`` while the loop works on an
    item, between two ``next()``: as many times as it happens to (1 to 100, from an RNG that is
    not the global one). (Draws made *during* ``next()`` would come from the pipeline's states,
    which are process-wide while the item is produced: the docs say so.)"""

    def __init__(self) -> None:
        self.gap, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.closing = False
        self.draws = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        how_many = random.SystemRandom()
        while self.gap.acquire(timeout=30) and not self.closing:
            for _ in range(how_many.randrange(1, 101)):
                random.random()
                self.draws += 1
            self.done.release()

    def between_items(self) -> None:
        self.gap.release()
        assert self.done.acquire(timeout=30), "the thread answers"

    def close(self) -> None:
        self.closing = True
        self.gap.release()
        self.thread.join(30)


def two_epochs(make_dl: Any, between_items: Callable[[], None], read_ahead: bool = False) -> List[Any]:
    pipe = IterableWrapper(range(400)).shuffle().sharding_filter().map(with_global_normals)
    dl = make_dl(pipe, rs(0, read_ahead=read_ahead))
    items = []
    for _ in range(2):
        for item in dl:
            items.append(item)
            between_items()
    return items


class TestRestoreSemantics(SuiteTestCase):
    @parametrize("via", ["from_state", "load_state_dict"])
    @parametrize("options", [{"num_workers": 0}, {"stateful": False}, {"max_items_between_captures": 2}])
    def test_restore_checkpoint_beginning_of_epoch_restarts_the_saved_epoch(
        self, via: str, options: Any
    ) -> None:
        options = {"num_workers": 2, **options}
        dl = self.make_dl(pipeline("shuffle_after_sharding", 40), rs(**options))
        first_epoch = list(dl)
        it = iter(dl)
        second_epoch_head = take(it, 7)
        state = dl.state_dict()
        second_epoch = second_epoch_head + list(it)
        assert second_epoch != first_epoch
        if via == "from_state":
            again = DataLoader2.from_state(state, rs(**options))
        else:
            again = DataLoader2(pipeline("shuffle_after_sharding", 40), reading_service=rs(**options))
            again.load_state_dict(state)
        try:
            again._restore_checkpoint_beginning_of_epoch()
            assert list(again) == second_epoch, "the whole saved epoch, from its first item"
        finally:
            again.shutdown()

    def test_without_that_call_the_saved_epoch_resumes_mid_epoch(self) -> None:
        dl = self.make_dl(pipeline("shuffle_after_sharding", 40), rs(2))
        it = iter(dl)
        head = take(it, 7)
        state = dl.state_dict()
        rest = list(it)
        again = DataLoader2.from_state(state, rs(2))
        try:
            assert list(again) == rest and len(head) == 7
        finally:
            again.shutdown()

    @parametrize("num_workers", [0, 2])
    def test_an_unseeded_loader_resumes_mid_epoch_even_when_it_draws_the_saved_epochs_seed(
        self, num_workers: int
    ) -> None:
        """Unseeded, DataLoader2 seeds its generator from torch's global RNG at every iter(); a fresh
        process draws the same first value as the run it restores, which must not be taken for
        _restore_checkpoint_beginning_of_epoch()."""
        torch.manual_seed(5)  # as in a fresh process
        dl = self.make_dl(pipeline("shuffle_before_sharding", 40), rs(num_workers), seed=None)
        it = iter(dl)
        take(it, 7)
        state = dl.state_dict()
        rest = list(it)
        torch.manual_seed(5)  # the restoring process draws the same generator seed
        again = DataLoader2.from_state(state, rs(num_workers))
        try:
            assert list(again) == rest
        finally:
            again.shutdown()

    def test_num_workers_0_reading_ahead_runs_the_map_for_items_the_user_has_not_asked_for(self) -> None:
        self.monkeypatch.setattr(outlet_module, "READ_AHEAD_S", 60.0)  # (the count bound)
        dl = self.make_dl(IterableWrapper(range(300)).map(count_calls), rs(0, read_ahead=True))
        CALLS[0] = 0
        it = iter(dl)
        assert CALLS[0] == 0, "iter() runs no item"
        assert next(it) == 0 and CALLS[0] == READ_AHEAD_ITEMS

    @parametrize("read_ahead", [False, True])
    def test_num_workers_0_data_do_not_depend_on_what_the_training_loop_draws(self, read_ahead: bool) -> None:
        alone = two_epochs(self.make_dl, lambda: None, read_ahead)
        assert len(alone) == 800
        assert two_epochs(self.make_dl, training_loop_draws, read_ahead) == alone
        other = OtherThread()
        try:
            assert two_epochs(self.make_dl, other.between_items, read_ahead) == alone
        finally:
            other.close()
        assert other.draws >= 800

    def test_num_workers_0_reading_ahead_gives_the_same_data_and_checkpoints(self) -> None:
        """Reading ahead is for throughput only: a state taken in one mode resumes in the other."""
        pipe = IterableWrapper(range(100)).shuffle().sharding_filter().map(with_global_normals)
        lazy = self.make_dl(pipe, rs(0))
        epoch = list(lazy)
        for taken_with in (False, True):
            dl = self.make_dl(pipe, rs(0, read_ahead=taken_with))
            it = iter(dl)
            assert take(it, 37) == epoch[:37]
            state = dl.state_dict()
            again = DataLoader2.from_state(state, rs(0, read_ahead=not taken_with))
            try:
                assert list(again) == epoch[37:]
            finally:
                again.shutdown()


instantiate_parametrized_tests(TestRestoreSemantics)


if __name__ == "__main__":
    unittest.main()
