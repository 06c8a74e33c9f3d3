"""Preemption (SLURM, Kubernetes): on SIGTERM, finish the step, save, exit; resume exactly.

    python examples/preemption.py [--group]           the demo (below)
    python examples/preemption.py train --workdir D    one training process: resumes from
                                                        D/checkpoint.pt if it exists
    python examples/preemption.py reference --workdir D   the run never preempted, in D/reference.pkl

A scheduler that preempts a job sends SIGTERM and, after a grace period, SIGKILL. Kubernetes
signals the container's main process; SLURM (``scancel``, ``--signal``) every process of the
job, workers included (``--group`` does that here). The pattern:

1. a SIGTERM handler only sets a flag;
2. the training loop checks the flag after each step: the step in progress finishes, then model,
   optimizer and ``dl.state_dict()`` are saved (atomically: a temporary file, then
   ``os.replace``) and the process exits with 0;
3. the resumed job loads them (``torchdata_snapshot.load_state_dict(dl, ...)``) and continues exactly.

The workers of ``torchdata_snapshot`` ignore SIGTERM (their lifetime is the training process's),
so the step in progress and the checkpoint do not lose them, and ``state_dict()`` does not talk
to them anyway. The demo trains until step ``--preempt-at``, sends SIGTERM, resumes in a new
process and checks the batches against a run that was never preempted.
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, List, Tuple

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")

import torch  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from torchdata_snapshot import MultiProcessingReadingService, load_state_dict  # noqa: E402

SEED, EPOCHS = 11, 2


def sample(x: int) -> Tuple[float, float]:
    noise = float(torch.randn(()) * 0.1)  # a global RNG, seeded by DataLoader2 in every worker
    return x / 1000 + noise, 3 * x / 1000 + 1


def build() -> Any:
    return IterableWrapper(range(1000)).shuffle().sharding_filter().map(sample).batch(10)


def reading_service() -> MultiProcessingReadingService:
    return MultiProcessingReadingService(num_workers=2, worker_prefetch_cnt=10, main_prefetch_cnt=10)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> None:
    xs, ys = torch.tensor(batch).unbind(1)
    loss = torch.nn.functional.mse_loss(model(xs.unsqueeze(1)), ys.unsqueeze(1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def save_atomically(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(workdir: Path) -> None:
    preempted = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.set())

    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = workdir / "checkpoint.pt"
    if path.exists():
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        dl = DataLoader2(build(), reading_service=reading_service())
        load_state_dict(dl, checkpoint["data"])
        epoch, step, seen = checkpoint["epoch"], checkpoint["step"], pickle.loads(checkpoint["seen"])
    else:
        dl = DataLoader2(build(), reading_service=reading_service())
        dl.seed(SEED)
        epoch, step, seen = 0, 0, []

    def save_and_exit(epoch: int) -> None:
        # ``epoch`` is the epoch to continue: the current one mid-epoch, the next one after its end.
        save_atomically(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "data": dl.state_dict(), "epoch": epoch, "step": step,
                               "seen": pickle.dumps(seen)})  # fmt: skip
        dl.shutdown()
        print(f"preempted: saved at step {step}, exiting", flush=True)
        sys.exit(0)

    while epoch < EPOCHS:
        for batch in dl:
            train_step(model, optimizer, batch)
            seen.append((epoch, batch))
            step += 1
            print(f"step {step}", flush=True)
            if preempted.is_set():
                save_and_exit(epoch)
        epoch += 1
        if preempted.is_set():
            save_and_exit(epoch)
    dl.shutdown()
    (workdir / "done.pkl").write_bytes(pickle.dumps((seen, model.weight.item())))


def reference() -> Tuple[List[Any], float]:
    """The same training, never preempted."""
    torch.manual_seed(0)  # (the model's initialization; the data is seeded by dl.seed)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with DataLoader2(build(), reading_service=reading_service()) as dl:
        dl.seed(SEED)
        for epoch in range(EPOCHS):
            for batch in dl:
                train_step(model, optimizer, batch)
                seen.append((epoch, batch))
    return seen, model.weight.item()


def start(workdir: str) -> subprocess.Popen:
    """A training process in its own process group (as a job step is)."""
    return subprocess.Popen([sys.executable, __file__, "train", "--workdir", workdir],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def preempt_at(process: subprocess.Popen, step: int, group: bool) -> List[str]:
    """Send SIGTERM once the process printed ``step``; what it printed from then on."""
    assert process.stdout is not None
    after: List[str] = []
    for line in process.stdout:
        if after or line == f"step {step}\n":
            if not after:
                os.killpg(process.pid, signal.SIGTERM) if group else process.send_signal(signal.SIGTERM)
            after.append(line.strip())
    return after


def demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as workdir:
        expected, weight = reference()
        who = "every process of the job" if args.group else "the training process"
        print(f"1. training; SIGTERM to {who} after step {args.preempt_at}")
        process = start(workdir)
        after = preempt_at(process, args.preempt_at, args.group)
        code = process.wait(timeout=120)
        print(f"   exit code {code}; it printed after the signal: {after[-2:]}")
        print("2. resuming in a new process")
        process = start(workdir)
        assert process.stdout is not None
        steps = sum(1 for line in process.stdout if line.startswith("step "))
        code2 = process.wait(timeout=300)
        seen, got_weight = pickle.loads(Path(workdir, "done.pkl").read_bytes())
        print(f"   exit code {code2}; {steps} more steps")
        ok = code == 0 and code2 == 0 and seen == expected and got_weight == weight
        verdict = "identical to" if seen == expected else "DIFFERENT from"
        print(f"report: {len(seen)} batches, {verdict} the run that was never preempted; "
              f"final weight {got_weight:.6f} (never preempted: {weight:.6f})")  # fmt: skip
        return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="demo", choices=["demo", "train", "reference"])
    parser.add_argument("--workdir", default="")
    parser.add_argument("--preempt-at", type=int, default=60, help="the demo's step of the SIGTERM")
    parser.add_argument("--group", action="store_true", help="SIGTERM every process (SLURM)")
    args = parser.parse_args()
    if args.command == "train":
        torch.manual_seed(0)  # the model's initialization (a resumed one loads its weights)
        train(Path(args.workdir))
    elif args.command == "reference":
        Path(args.workdir, "reference.pkl").write_bytes(pickle.dumps(reference()))
    else:
        sys.exit(demo(args))


if __name__ == "__main__":
    main()
