"""Chaos runs: workers and whole training processes killed at random moments; the data must be
exactly that of an uninterrupted run.

    python scripts/chaos.py workers  [--epochs 3] [--items 6000] [--workers 4] [--kills 20]
    python scripts/chaos.py restarts [--epochs 3] [--items 6000] [--workers 4] [--cycles 20]
    python scripts/chaos.py all      (both; what scripts/chaos.sh runs)

``--tensor-pool`` runs both with ``tensor_pool=True``: each item then carries a tensor, which
reaches the training loop as a view of a worker's pool. ``--no-tensor-pool`` runs them with
``tensor_pool=False``; without either, the reading service has its default (the pool where the
platform has it; the items carry no tensor).

``workers``: a multi-epoch job with ``restart_dead_workers`` and a checkpoint every few steps,
while a killer thread SIGKILLs a random worker after random intervals (also between epochs and
during checkpoints). Every batch is compared with the uninterrupted run's.

``restarts``: ``--cycles`` times, a training process is started from the last checkpoint (the
first from scratch) and SIGKILLed at a random step, mid-epoch or between epochs, while it
checkpoints every few steps (written atomically: a temporary file, then ``os.replace``). A last
process finishes the job. The batches each process consumed up to its last checkpoint, in turn,
must be the uninterrupted run's.

Each prints a summary (kills, restarts, batches compared, mismatches) and exits non-zero on any
mismatch or error. ``--seed`` makes the kill schedule reproducible (the timing of a kill relative
to what the processes are doing is not).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")

import torch  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from torchdata_snapshot import MultiProcessingReadingService  # noqa: E402

SEED = 7
BATCH = 8
Batches = List[Tuple[int, Any]]  # (epoch, batch), in the order the training loop consumed them


def augment(x: int) -> tuple:
    """Per-item randomness from the global RNGs DataLoader2 seeds in every worker."""
    return (x, random.randint(0, 999), int(torch.randint(0, 999, ())))


def augment_to_tensor(x: int) -> tuple:
    """:func:`augment`, its torch draw a tensor: what the tensor pool carries."""
    return (x, random.randint(0, 999), torch.randint(0, 999, (1,)))


def build(args: argparse.Namespace) -> Any:
    source = IterableWrapper(range(args.items)).shuffle().sharding_filter()
    return source.map(augment_to_tensor if args.tensor_pool else augment).batch(BATCH)


def plain(batch: Any) -> Any:
    """``batch`` with its tensors as lists, to compare with ``==`` and keep without holding a
    pool's slot."""
    return [(x, r, t.tolist() if isinstance(t, torch.Tensor) else t) for x, r, t in batch]


def reading_service(args: argparse.Namespace, **faults: Any) -> MultiProcessingReadingService:
    return MultiProcessingReadingService(
        num_workers=args.workers,
        worker_prefetch_cnt=10,
        main_prefetch_cnt=10,
        multiprocessing_context=args.start_method,
        tensor_pool=True if args.tensor_pool else (False if args.no_tensor_pool else None),
        **faults,
    )


def reference(args: argparse.Namespace) -> Batches:
    """The uninterrupted run: the ground truth."""
    with DataLoader2(build(args), reading_service=reading_service(args)) as dl:
        dl.seed(SEED)
        return [(epoch, plain(batch)) for epoch in range(args.epochs) for batch in dl]


def compare(name: str, got: Batches, expected: Batches) -> int:
    """Print how ``got`` compares with ``expected``; the number of mismatching batches (a missing
    or extra batch counts as one)."""
    mismatches = sum(a != b for a, b in zip(got, expected)) + abs(len(got) - len(expected))
    print(f"{name}: {len(expected)} batches compared with the uninterrupted run, mismatches: {mismatches}")
    if mismatches:
        differ = (i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        first = next(differ, min(len(got), len(expected)))
        print(f"   first mismatch at batch {first}: got {got[first : first + 1]}")
        print(f"   expected {expected[first : first + 1]}")
    return mismatches


# --- workers killed under a running job ---------------------------------------------------------


def descends_from_us(pid: int) -> bool:
    """Whether ``pid`` is a process below this one (so that a pid reused by the system after a
    worker's death is never killed); forkserver workers are grandchildren."""
    for _ in range(3):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
        if pid == os.getpid():
            return True
    return False


class Killer(threading.Thread):
    """SIGKILLs a random worker when the training loop reaches each of ``at_steps``, after a
    random part of a step (so that the kill lands anywhere: in the middle of a batch, of a
    checkpoint, of an epoch's end). The loop reports its progress and the workers' pids."""

    def __init__(self, at_steps: List[int], seed: int) -> None:
        super().__init__(daemon=True)
        self.at_steps = sorted(at_steps)
        self.random = random.Random(seed)
        self.progress = threading.Condition()
        self.epoch = self.step = 0
        self.done = False
        self.pids: List[int] = []
        self.killed: List[Tuple[int, int, int]] = []  # (epoch, step, pid) of each kill

    def advance(self, epoch: int, step: int, pids: Optional[List[int]] = None) -> None:
        with self.progress:
            self.epoch, self.step = epoch, step
            if pids is not None:
                self.pids = pids
            self.progress.notify()

    def finish(self) -> None:
        with self.progress:
            self.done = True
            self.progress.notify()
        self.join(30)

    def _alive(self) -> List[int]:
        return [pid for pid in self.pids if pid not in {p for _, _, p in self.killed}]

    def kill_one(self) -> None:
        with self.progress:
            # (A snapshot answered just before a kill may report the killed pid once more.)
            candidates = [pid for pid in self._alive() if descends_from_us(pid)]
            if not candidates:
                print(f"   (no worker to kill at step {self.step}: {self.pids})")
            if candidates:
                pid = self.random.choice(candidates)
                os.kill(pid, signal.SIGKILL)
                self.killed.append((self.epoch, self.step, pid))

    def run(self) -> None:
        for target in self.at_steps:
            with self.progress:
                self.progress.wait_for(lambda: self.done or (self.step >= target and self._alive()))  # noqa: B023
                if self.done:
                    return
            time.sleep(self.random.uniform(0, 0.004))  # a random moment within the next step or two
            self.kill_one()


@contextlib.contextmanager
def restarts_logged() -> Iterator[List[int]]:
    """The pids of the dead workers the reading service restarts inside the block (it logs each
    restart at WARNING)."""
    pids: List[int] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if m := re.search(r"\(pid (\d+)\) died .* restarting it", record.getMessage()):
                pids.append(int(m[1]))

    handler, logger = Collect(), logging.getLogger("torchdata_snapshot")
    logger.addHandler(handler)
    try:
        yield pids
    finally:
        logger.removeHandler(handler)


def chaos_workers(args: argparse.Namespace) -> int:
    expected = reference(args)
    rng = random.Random(args.seed)
    between = rng.sample(range(1, args.epochs), min(args.kills // 5, args.epochs - 1))
    killer = Killer([rng.randrange(1, len(expected)) for _ in range(args.kills - len(between))], args.seed)
    got: Batches = []
    with restarts_logged() as restarted:
        rs = reading_service(args, restart_dead_workers=args.kills + 1)
        with contextlib.ExitStack() as stack:
            dl = stack.enter_context(DataLoader2(build(args), reading_service=rs))  # (a copy of rs)
            dl.seed(SEED)
            killer.start()
            stack.callback(killer.finish)  # on the way out, also after a failure
            step = 0
            for epoch in range(args.epochs):
                if epoch in between:  # a worker dies while the job is between two epochs
                    killer.advance(epoch, step, [w.pid for w in dl.reading_service.snapshot()])
                    killer.kill_one()
                for batch in dl:
                    got.append((epoch, plain(batch)))
                    step += 1
                    pids = None
                    if step % 10 == 0:  # a checkpoint; the killer learns the workers' new pids
                        dl.state_dict()
                        pids = [worker.pid for worker in dl.reading_service.snapshot()]
                    killer.advance(epoch, step, pids)
            # Kills due at the last steps land after them; each snapshot finds and replaces the dead.
            while killer.is_alive():
                killer.advance(epoch, step, [w.pid for w in dl.reading_service.snapshot()])
                killer.join(0.05)
            dl.reading_service.snapshot()  # a worker killed last is found (and replaced)
    restarts = len(restarted)
    per_epoch = [sum(e == epoch for e, _, _ in killer.killed) for epoch in range(args.epochs)]
    print(f"workers: {len(killer.killed)} workers SIGKILLed at random moments "
          f"({len(between)} between epochs; per epoch: {per_epoch}), {restarts} restarted")  # fmt: skip
    not_restarted = [kill for kill in killer.killed if kill[2] not in restarted]
    if not_restarted:
        print(f"   killed and not restarted (epoch, step, pid): {not_restarted}")
    mismatches = compare("workers", got, expected)
    return 1 if mismatches or restarts != len(killer.killed) else 0


# --- the training process killed and resumed ------------------------------------------------------


def save_atomically(path: Path, obj: Any) -> None:
    """A checkpoint is complete or absent, whenever the process is killed."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(args: argparse.Namespace) -> None:
    """One training process: resumes from ``checkpoint.pt`` if there is one, prints each step,
    checkpoints every ``--checkpoint-every`` steps with what it consumed so far."""
    path = Path(args.workdir, "checkpoint.pt")
    if path.exists():
        checkpoint = torch.load(path, weights_only=True)
        dl = DataLoader2.from_state(checkpoint["data"], reading_service(args))
        first_epoch, consumed = checkpoint["epoch"], pickle.loads(checkpoint["consumed"])
    else:
        dl = DataLoader2(build(args), reading_service=reading_service(args))
        dl.seed(SEED)
        first_epoch, consumed = 0, []
    step = 0
    for epoch in range(first_epoch, args.epochs):
        for batch in dl:
            consumed.append((epoch, plain(batch)))
            step += 1
            print(f"step {step}", flush=True)
            if step % args.checkpoint_every == 0:
                checkpoint = {"epoch": epoch, "data": dl.state_dict(), "consumed": pickle.dumps(consumed)}
                save_atomically(path, checkpoint)
    dl.shutdown()
    Path(args.workdir, "done.pkl").write_bytes(pickle.dumps(consumed))


def run_until_killed(args: argparse.Namespace, kill_after: Optional[int]) -> Tuple[int, int]:
    """Run one training process; SIGKILL it once it printed ``kill_after`` steps (never if None).
    Its exit code and the steps it printed."""
    command = [sys.executable, __file__, "train", "--workdir", args.workdir, "--items", str(args.items),
               "--epochs", str(args.epochs), "--workers", str(args.workers), "--start-method",
               args.start_method, "--checkpoint-every", str(args.checkpoint_every)]  # fmt: skip
    if args.tensor_pool:
        command.append("--tensor-pool")
    if args.no_tensor_pool:
        command.append("--no-tensor-pool")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    steps = 0
    try:
        assert process.stdout is not None
        for line in process.stdout:
            steps += line.startswith("step ")
            if kill_after is not None and steps >= kill_after:
                process.kill()  # the step goes on in the process until the signal lands
                break
        return process.wait(timeout=600), steps
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def chaos_restarts(args: argparse.Namespace) -> int:
    expected = reference(args)
    rng = random.Random(args.seed)
    # Each process is killed a random number of steps after it starts, up to twice the job's
    # length divided by the cycles: the kills spread over the whole job, mid-epoch and at epochs'
    # ends, sometimes before a process's first checkpoint (it then resumes from the one before).
    longest = max(2, 2 * len(expected) // args.cycles)
    kills = 0
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        for _ in range(args.cycles):
            code, _ = run_until_killed(args, kill_after=rng.randint(1, longest))
            if Path(workdir, "done.pkl").exists():
                break
            if code != -signal.SIGKILL:
                print(f"restarts: a training process failed with exit code {code}")
                return 1
            kills += 1
        if not Path(workdir, "done.pkl").exists():
            code, _ = run_until_killed(args, kill_after=None)
            if code != 0:
                print(f"restarts: the last training process failed with exit code {code}")
                return 1
        got = pickle.loads(Path(workdir, "done.pkl").read_bytes())
    print(f"restarts: {kills} training processes SIGKILLed at random steps and resumed from their "
          f"last checkpoint")  # fmt: skip
    return 1 if compare("restarts", got, expected) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["workers", "restarts", "all", "train"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--items", type=int, default=6000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kills", type=int, default=20, help="workers: how many workers to kill")
    parser.add_argument("--cycles", type=int, default=20, help="restarts: how many processes to kill")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--start-method", default="fork", choices=["fork", "spawn", "forkserver"])
    parser.add_argument("--tensor-pool", action="store_true", help="tensor_pool=True; items carry a tensor")
    parser.add_argument("--no-tensor-pool", action="store_true", help="tensor_pool=False")
    parser.add_argument("--seed", type=int, default=None, help="of the kill schedule (default: random)")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.randrange(2**32)
    if args.start_method == "forkserver":
        # Each worker (and each replacement) then starts in milliseconds instead of importing
        # torch anew (docs/performance.rst).
        multiprocessing.set_forkserver_preload(["torch", "torchdata.datapipes", "torchdata_snapshot"])
    if args.command == "train":
        train(args)
        return
    print(f"chaos: --seed {args.seed}, {args.workers} workers ({args.start_method}), {args.epochs} epochs "
          f"of {args.items} items{', tensor pool' if args.tensor_pool else ''}")  # fmt: skip
    failed = 0
    if args.command in ("workers", "all"):
        failed |= chaos_workers(args)
    if args.command in ("restarts", "all"):
        failed |= chaos_restarts(args)
    print("chaos: FAILED" if failed else "chaos: passed")
    sys.exit(failed)


if __name__ == "__main__":
    main()
