"""Elastic resume: a job of 2 ranks is killed mid-epoch and resumed by a job of 3.

    torchrun --nproc-per-node 2 examples/elastic_resume.py --dir D --kill-at 5
    torchrun --nproc-per-node 3 examples/elastic_resume.py --dir D

The first job trains (here: collects the batches it receives) with 2 workers per rank and saves,
after every step, what every rank needs to resume: ``gather_elastic_state(dl.state_dict())``,
the one collective call a distributed training loop adds (every rank's state travels).
At step ``--kill-at`` the job is preempted: every rank ends at once, with ``os._exit(0)``. That
runs no ``shutdown()``, no ``finally`` and no exit handler, so the data pipeline sees what a
SIGKILL would leave (its workers end on their own), but torchrun reads the exit code as done: the
first job ends with exit code 0 and a line saying it was preempted on purpose, not with the
``ChildFailedError`` report a signal would print.

The second job has another world size and 1 worker per rank. Each rank loads any rank's state
(here rank ``r`` loads ``r % 2``'s) into ``MultiProcessingReadingService(num_workers=1,
elastic=True)``: the rest of the epoch delivers, over all new ranks, every element the old job's
user had not received, exactly once. Rank 0 then checks that against the whole dataset, and
prints ``exactly once: N elements``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any, List

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from torchdata_snapshot import MultiProcessingReadingService, gather_elastic_state, load_state_dict  # noqa: E402

#: 2 ranks x 2 workers and 3 ranks x 1 worker both split it evenly, so that fullsync (which
#: ends an epoch of DistributedReadingService at the shortest rank) cuts nothing.
ELEMENTS, BATCH, SEED = 1200, 4, 17


def build() -> Any:
    return IterableWrapper(range(ELEMENTS)).shuffle().sharding_filter().batch(BATCH)


def loader(state: Any, num_workers: int) -> DataLoader2:
    reading_service = SequentialReadingService(
        DistributedReadingService(), MultiProcessingReadingService(num_workers=num_workers, elastic=True)
    )
    dl = DataLoader2(build(), reading_service=reading_service)
    if state is not None:
        load_state_dict(dl, state)  # checked against the pipeline build() makes, before any worker starts
        return dl
    dl.seed(SEED)
    return dl


def save_atomically(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def first_job(workdir: Path, kill_at: int) -> None:
    rank = dist.get_rank()
    dl = loader(None, num_workers=2)
    received: List[int] = []
    for step, batch in enumerate(dl, start=1):
        received.extend(batch)  # a training step
        state = gather_elastic_state(dl.state_dict())  # collective: every rank, every checkpoint
        save_atomically(workdir / f"rank{rank}.pt", {"data": state, "received": received})
        dist.barrier()  # every rank saved this step
        if step == kill_at:
            if rank == 0:
                print(
                    f"preempted on purpose at step {step}: every rank saved its state in {workdir} and "
                    "ends now, without shutting anything down (as if SIGKILLed). Resume with another "
                    f"world size: torchrun --nproc-per-node 3 {__file__} --dir {workdir}",
                    flush=True,
                )
            os._exit(0)  # preempted: no shutdown(), no finally, no atexit


def second_job(workdir: Path) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    saved = sorted(workdir.glob("rank*.pt"))
    checkpoint = torch.load(saved[rank % len(saved)], weights_only=True)  # any rank's state fits
    dl = loader(checkpoint["data"], num_workers=1)
    received = [x for batch in dl for x in batch]  # the rest of the epoch
    dl.shutdown()
    (workdir / f"resumed{rank}.json").write_text(json.dumps(received))
    dist.barrier()
    if rank == 0:
        before = [x for path in saved for x in torch.load(path, weights_only=True)["received"]]
        after = [x for r in range(world_size) for x in json.loads((workdir / f"resumed{r}.json").read_text())]
        assert sorted(before + after) == list(range(ELEMENTS)), "some element was lost or delivered twice"
        print(
            f"exactly once: {ELEMENTS} elements ({len(before)} by {len(saved)} ranks before the kill, "
            f"{len(after)} by {world_size} ranks after)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, required=True, help="where the ranks save their states")
    parser.add_argument("--kill-at", type=int, help="first job: the step at which every rank is killed")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        if args.kill_at is not None:
            args.dir.mkdir(parents=True, exist_ok=True)
            first_job(args.dir, args.kill_at)
        else:
            second_job(args.dir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
