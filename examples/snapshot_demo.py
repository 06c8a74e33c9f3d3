"""Watch the workers of a DataLoader2 while it runs: MultiProcessingReadingService.snapshot().

    python examples/snapshot_demo.py [--items 2000] [--every 400]

Four workers shuffle, shard and transform a stream; every ``--every`` items the demo prints one
line per worker: what its graph produced, what the main process received and handed on, and
what sits in buffers. The counts always add up, and taking snapshots never changes the data.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any, List

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")

from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from torchdata_snapshot import MultiProcessingReadingService, WorkerSnapshot  # noqa: E402


def square(x: int) -> int:
    return x * x


def build(items: int) -> Any:
    return IterableWrapper(range(items)).shuffle().sharding_filter().map(square)


def run(items: int, every: int, snapshots: bool) -> List[int]:
    rs = MultiProcessingReadingService(num_workers=4, worker_prefetch_cnt=10, main_prefetch_cnt=10)
    with DataLoader2(build(items), reading_service=rs) as dl:
        dl.seed(0)
        out = []
        for step, item in enumerate(dl, start=1):
            out.append(item)
            if snapshots and step % every == 0:
                show(step, dl.reading_service.snapshot())
        return out


def show(step: int, snaps: List[WorkerSnapshot]) -> None:
    print(f"after {step} items:")
    for s in snaps:
        print(
            f"  worker {s.worker_id} (pid {s.pid}): produced {s.produced:5d}  main received {s.received:5d}"
            f"  handed on {s.handed_on:5d}  buffered in main {s.buffered_in_main:3d}"
        )
        assert s.produced == s.sent + s.buffered and s.received == s.handed_on + s.buffered_in_main
    assert sum(s.handed_on for s in snaps) == step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--every", type=int, default=400)
    args = parser.parse_args()
    observed = run(args.items, args.every, snapshots=True)
    reference = run(args.items, args.every, snapshots=False)
    assert observed == reference, "snapshots changed the data"
    print(f"{len(observed)} items, identical to a run without snapshots.")


if __name__ == "__main__":
    main()
