"""The pipelines every peer runs: tiny items, CPU-heavy items, large tensors, and real formats
(text shards, WebDataset-style image shards: see ``formats``).

Each workload builds the same IterDataPipe graph for every peer (DataLoader2 with upstream's or
our reading service, ``torch.utils.data.DataLoader``, torchdata's ``StatefulDataLoader``; the
last two accept an IterDataPipe as an IterableDataset and shard it per worker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple

import formats
import torch
from torchdata.datapipes.iter import IterableWrapper

#: Records of one epoch of the real formats: 40 files of 5,000 lines; 16 shards of 250 images.
TEXT_LINES = 200_000
IMAGES = 4_000


def add_one(x: int) -> int:
    return x + 1


def burn(loops: int, x: int) -> int:
    """About 1 ms of pure-Python work (``loops`` is calibrated on this machine)."""
    total = x
    for i in range(loops):
        total += i * i
    return total % 1000


def wait(seconds: float, x: int) -> int:
    """An item that takes ``seconds`` waiting (reading a remote file, decoding on a device)."""
    time.sleep(seconds)
    return x


def big_tensor(numel: int, x: int) -> torch.Tensor:
    """A ~1 MB tensor: where shared memory matters."""
    return torch.full((numel,), float(x))


def tokens(numel: int, x: int) -> torch.Tensor:
    """``numel`` int64 token ids (8,192 of them: a 64 KB item)."""
    return torch.full((numel,), x, dtype=torch.int64)


def calibrate_burn(target_s: float = 0.001) -> int:
    loops = 10_000
    while True:
        start = time.perf_counter()
        burn(loops, 0)
        elapsed = time.perf_counter() - start
        if elapsed > 0.02:
            return max(1, int(loops * target_s / elapsed))
        loops *= 2


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[int], Any]
    items: int  # items per measured run for fast peers
    slow_items: int  # items per run for upstream's MPRS (two orders of magnitude slower on tiny items)
    item_bytes: int = 0  # the bytes of tensor data an item holds (0: not a tensor workload)


def workloads(burn_loops: int) -> Dict[str, Workload]:
    return {
        "tiny": Workload(
            "tiny",
            "range -> shuffle -> sharding_filter -> map(x + 1)",
            lambda n: IterableWrapper(range(n)).shuffle().sharding_filter().map(add_one),
            items=100_000,
            slow_items=5_000,
        ),
        "cpu_heavy": Workload(
            "cpu_heavy",
            "range -> shuffle -> sharding_filter -> map(~1 ms of Python)",
            lambda n: IterableWrapper(range(n)).shuffle().sharding_filter().map(partial(burn, burn_loops)),
            items=2_000,
            slow_items=2_000,
        ),
        "large_tensors": Workload(
            "large_tensors",
            "range -> sharding_filter -> map(1 MB float32 tensor)",
            lambda n: IterableWrapper(range(n)).sharding_filter().map(partial(big_tensor, 256 * 1024)),
            items=2_000,
            slow_items=1_000,
            item_bytes=1 << 20,
        ),
        "tokens_64kb": Workload(
            "tokens_64kb",
            "range -> sharding_filter -> map(8,192 int64 tokens, 64 KB)",
            lambda n: IterableWrapper(range(n)).sharding_filter().map(partial(tokens, 8192)),
            items=5_000,
            slow_items=2_000,
            item_bytes=64 << 10,
        ),
        "text_shards": Workload(
            "text_shards",
            "40 text files -> shuffle -> sharding_filter -> open -> readlines -> tokenize -> batch(16)",
            formats.text_pipeline,
            items=TEXT_LINES,
            slow_items=TEXT_LINES,
        ),
        "image_shards": Workload(
            "image_shards",
            "16 tar shards of JPEGs -> shuffle -> sharding_filter -> open -> load_from_tar -> "
            "webdataset -> decode -> batch(8)",
            formats.image_pipeline,
            items=IMAGES,
            slow_items=IMAGES,
            item_bytes=8 * 3 * formats.IMAGE_SIDE**2,  # a batch: 8 decoded images, uint8 CHW
        ),
    }


@dataclass(frozen=True)
class RestoreWorkload:
    """A pipeline whose restore time is measured at positions ``ks`` (``ks[0]`` is 0)."""

    name: str
    description: str
    build: Callable[[int], Any]  # source items -> pipeline
    items_per_k: int  # source items behind one position (8 for batches of 8)
    ks: Tuple[int, ...]
    quick_ks: Tuple[int, ...]
    epoch_items: Optional[int] = None  # files: one epoch of this many records, whatever k
    files: int = 0  # files: how many the epoch reads


def restore_workloads(burn_loops: int) -> Dict[str, RestoreWorkload]:
    """Early positions (before the first capture of a count-paced scheme), late ones, slow items."""
    shuffled = lambda n, size=1000: IterableWrapper(range(n)).shuffle(buffer_size=size).sharding_filter()  # noqa: E731
    return {
        "tiny_batched": RestoreWorkload(
            "tiny_batched",
            "range -> shuffle(1000) -> sharding_filter -> map(x + 1) -> batch(8)",
            lambda n: shuffled(n).map(add_one).batch(8),
            8,
            (0, 100, 2_000, 20_000, 200_000),
            (0, 100, 2_000, 20_000),
        ),
        "1ms_items": RestoreWorkload(
            "1ms_items",
            "range -> shuffle(1000) -> sharding_filter -> map(~1 ms of Python)",
            lambda n: shuffled(n).map(partial(burn, burn_loops)),
            1,
            (0, 50, 600, 3_000),
            (0, 600),
        ),
        "20ms_items": RestoreWorkload(
            "20ms_items",
            "range -> shuffle(1000) -> sharding_filter -> map(20 ms wait)",
            lambda n: shuffled(n).map(partial(wait, 0.02)),
            1,
            (0, 10, 150),
            (0, 30),
        ),
        "buffer_10k": RestoreWorkload(
            "buffer_10k",
            "range -> shuffle(10,000) -> sharding_filter -> map(x + 1)",
            lambda n: shuffled(n, 10_000).map(add_one),
            1,
            (0, 100, 5_000, 50_000, 500_000),
            (0, 100, 50_000),
        ),
        # Files opened and parsed after sharding, k across the whole epoch (its last batch included).
        "text_shards": RestoreWorkload(
            "text_shards",
            "40 text files of 5,000 lines -> ... -> readlines -> tokenize -> batch(16)",
            formats.text_pipeline,
            16,
            (0, 100, 3_000, 10_000, TEXT_LINES // 16 - 1),
            (0, 3_000, TEXT_LINES // 16 - 1),
            epoch_items=TEXT_LINES,
            files=formats.TEXT_FILES,
        ),
        "image_shards": RestoreWorkload(
            "image_shards",
            "16 tar shards of 250 JPEGs -> ... -> webdataset -> decode -> batch(8)",
            formats.image_pipeline,
            8,
            (0, 50, 250, IMAGES // 8 - 1),
            (0, 250, IMAGES // 8 - 1),
            epoch_items=IMAGES,
            files=formats.IMAGE_SHARDS,
        ),
    }


@dataclass(frozen=True)
class StartupWorkload:
    """A pipeline whose epoch start is timed (see ``run_startup`` in ``run.py``)."""

    name: str
    description: str
    build: Callable[[], Any]


def upstream_example(pairs: int = 20_000) -> Any:
    """The pipeline of upstream's ``examples/dataloader2/train_loop_reading_service.py``: 20,000
    pairs of in-memory tensors, zipped, shuffled, sharded."""
    features = IterableWrapper([torch.rand(3) for _ in range(pairs)])
    labels = IterableWrapper([torch.rand(3) for _ in range(pairs)])
    return features.zip(labels).shuffle().sharding_filter()


def startup_workloads(smoke: bool = False) -> Dict[str, StartupWorkload]:
    """Upstream's example (its data held by the graph) and text files (the graph holds paths)."""
    lines, pairs = (4_000, 1_000) if smoke else (TEXT_LINES, 20_000)
    return {
        "upstream_example": StartupWorkload(
            "upstream_example",
            f"{pairs:,} pairs of in-memory tensors -> zip -> shuffle -> sharding_filter (upstream's example)",
            partial(upstream_example, pairs),
        ),
        "text_shards": StartupWorkload(
            "text_shards", formats.text_pipeline.__doc__ or "", partial(formats.text_pipeline, lines)
        ),
    }
