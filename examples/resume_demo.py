"""Kill a training job mid-epoch and resume its data pipeline exactly, in a new process.

    python examples/resume_demo.py [--items 4000] [--workers 4] [--checkpoint-every 25] [--kill-at 90]

1. ``reference``: an uninterrupted run of two epochs (the ground truth);
2. ``train``: the same job in a new process; every ``--checkpoint-every`` steps it saves
   ``torch.save(dl.state_dict())``; at step ``--kill-at`` (mid-epoch 1) it is killed with SIGKILL,
   like a preempted node, losing the steps after its last checkpoint;
3. ``resume``: a new process builds the pipeline, loads ``torch.load(checkpoint)`` into it with
   ``torchdata_snapshot.load_state_dict`` and finishes the job.

The report checks that the batches of (2) up to the checkpoint followed by those of (3) are the
reference, batch for batch: nothing lost, nothing duplicated, same order. The pipeline uses four
workers, prefetching on both sides, a shuffle, per-worker random augmentation from the global
RNGs DataLoader2 seeds, and batching.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, List

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")

import torch  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from torchdata_snapshot import MultiProcessingReadingService, load_state_dict  # noqa: E402

SEED = 2024
EPOCHS = 2


def augment(x: int) -> tuple:
    """A 'random crop': uses the global RNGs that DataLoader2 seeds in every worker."""
    return (x, random.randint(0, 99), int(torch.randint(0, 99, ())))


def build(items: int) -> Any:
    return IterableWrapper(range(items)).shuffle().sharding_filter().map(augment).batch(8)


def reading_service(workers: int) -> MultiProcessingReadingService:
    return MultiProcessingReadingService(num_workers=workers, worker_prefetch_cnt=10, main_prefetch_cnt=10)


def run_reference(args: argparse.Namespace) -> None:
    with DataLoader2(build(args.items), reading_service=reading_service(args.workers)) as dl:
        dl.seed(SEED)
        epochs = [list(dl) for _ in range(EPOCHS)]
    Path(args.workdir, "reference.pkl").write_bytes(pickle.dumps(epochs))


def run_training(args: argparse.Namespace) -> None:
    """The job that gets killed: checkpoints as it goes, appends every batch it consumed."""
    workdir = Path(args.workdir)
    dl = DataLoader2(build(args.items), reading_service=reading_service(args.workers))
    dl.seed(SEED)
    consumed: List[Any] = []  # (epoch, batch) in order
    step = last_checkpoint = 0
    for epoch in range(EPOCHS):
        for batch in dl:
            consumed.append((epoch, batch))  # "train" on it
            step += 1
            if step % args.checkpoint_every == 0:
                torch.save(dl.state_dict(), workdir / "data.ckpt")
                (workdir / "consumed_at_checkpoint.pkl").write_bytes(pickle.dumps(consumed))
                last_checkpoint = step
            if step == args.kill_at:
                pids = " ".join(str(s.pid) for s in dl.reading_service.snapshot())
                (workdir / "workers.txt").write_text(pids)
                print(f"   [train pid {os.getpid()}] step {step} (epoch {epoch}): SIGKILL; "
                      f"last checkpoint at step {last_checkpoint}", flush=True)  # fmt: skip
                os.kill(os.getpid(), signal.SIGKILL)


def run_resume(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    state = torch.load(workdir / "data.ckpt", weights_only=True)
    dl = DataLoader2(build(args.items), reading_service=reading_service(args.workers))
    load_state_dict(dl, state)  # checked against the pipeline just built, before any worker starts
    resumed_epoch = state["reading_service_state"]["epoch"]
    resumed = []
    for epoch in range(resumed_epoch, EPOCHS):
        resumed.extend((epoch, batch) for batch in dl)
    dl.shutdown()
    (workdir / "resumed.pkl").write_bytes(pickle.dumps(resumed))
    print(
        f"   [resume pid {os.getpid()}] continued epoch {resumed_epoch}: {len(resumed)} batches", flush=True
    )


def step(name: str, args: argparse.Namespace) -> int:
    command = [sys.executable, __file__, name, "--workdir", args.workdir, "--items", str(args.items),
               "--workers", str(args.workers), "--checkpoint-every", str(args.checkpoint_every),
               "--kill-at", str(args.kill_at)]  # fmt: skip
    return subprocess.run(command, timeout=600).returncode


def alive(pids: List[int]) -> List[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


def orchestrate(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        print(f"1. reference: an uninterrupted run of {EPOCHS} epochs ({args.workers} workers)")
        assert step("reference", args) == 0
        print(
            f"2. training, checkpointing every {args.checkpoint_every} steps, killed at step {args.kill_at}"
        )
        code = step("train", args)
        print(f"   the training process ended with exit code {code} (-9: SIGKILL)")
        worker_pids = [int(p) for p in Path(workdir, "workers.txt").read_text().split()]
        deadline = time.monotonic() + 15
        while alive(worker_pids) and time.monotonic() < deadline:
            time.sleep(0.1)  # the orphaned workers notice their parent is gone within ~1 s
        print(f"   its {len(worker_pids)} workers exited on their own: {not alive(worker_pids)}")
        print("3. resuming from the last checkpoint in a new process")
        assert step("resume", args) == 0

        reference = pickle.loads(Path(workdir, "reference.pkl").read_bytes())
        before = pickle.loads(Path(workdir, "consumed_at_checkpoint.pkl").read_bytes())
        after = pickle.loads(Path(workdir, "resumed.pkl").read_bytes())
        expected = [(epoch, batch) for epoch, batches in enumerate(reference) for batch in batches]
        got = before + after
        lost = len(expected) - len(got)
        ok = got == expected
        print("report:")
        print(f"   batches before the checkpoint: {len(before)}, after the resume: {len(after)}")
        print(f"   reference: {len(expected)} batches; resumed job: {len(got)} batches")
        if ok:
            print("   identical to the uninterrupted run, batch for batch: nothing lost, nothing duplicated")
        else:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))
            )
            print(f"   MISMATCH at batch {first} ({lost} batches missing)")
        return 0 if ok and not alive(worker_pids) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "command", nargs="?", default="demo", choices=["demo", "reference", "train", "resume"]
    )
    parser.add_argument("--workdir", default="")
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--kill-at", type=int, default=0, help="default: two thirds into the second epoch")
    args = parser.parse_args()
    if not args.kill_at:
        batches_per_epoch = -(-args.items // 8)
        args.kill_at = batches_per_epoch + (2 * batches_per_epoch) // 3
    if args.command == "reference":
        run_reference(args)
    elif args.command == "train":
        run_training(args)
    elif args.command == "resume":
        run_resume(args)
    else:
        sys.exit(orchestrate(args))


if __name__ == "__main__":
    main()
