"""Quickstart: checkpoint a DataLoader2 with the model, resume it, get exactly the same data.

    python examples/quickstart.py [--workdir DIR]

A tiny model trains on a shuffled, augmented, batched pipeline read by two workers. After
``CRASH_AT`` steps the job "crashes"; a new loader and model are built from the last
checkpoint (the pipeline built by the same code, the checkpoint loaded into it), and training
continues. The batches seen are checked against a run that never stopped.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")

import torch  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from torchdata_snapshot import MultiProcessingReadingService, load_state_dict  # noqa: E402

EPOCHS, CHECKPOINT_EVERY, CRASH_AT = 2, 10, 37


def augment(x: int) -> Tuple[float, float]:
    noise = random.gauss(0.0, 0.1)  # a global RNG: DataLoader2 seeds it in every worker
    return float(x) / 100 + noise, 3.0 * x / 100 + 1.0


def collate(batch: List[Tuple[float, float]]) -> Tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*batch)
    return torch.tensor(xs).unsqueeze(1), torch.tensor(ys).unsqueeze(1)


def build_pipeline() -> IterableWrapper:
    return IterableWrapper(range(400)).shuffle().sharding_filter().map(augment).batch(16).collate(collate)


def reading_service() -> MultiProcessingReadingService:
    return MultiProcessingReadingService(num_workers=2, worker_prefetch_cnt=10, main_prefetch_cnt=10)


def train(checkpoint: Path, crash_at: Optional[int], resume: bool) -> List[float]:
    """Train; save ``{model, optimizer, data}`` every CHECKPOINT_EVERY steps; stop at ``crash_at``.

    Returns the sum of every batch seen (a fingerprint of the data, in order).
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader2(build_pipeline(), reading_service=reading_service())
    if resume:
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        load_state_dict(dl, state["data"])  # checked against the pipeline just built, which runs
        step, epoch = state["step"], state["epoch"]
    else:
        dl.seed(2024)
        step, epoch = 0, 0
    seen: List[float] = []
    try:
        while epoch < EPOCHS:
            for x, y in dl:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen.append(round(float(x.sum() + y.sum()), 6))
                step += 1
                if step % CHECKPOINT_EVERY == 0:
                    torch.save(
                        {
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "data": dl.state_dict(),
                            "step": step,
                            "epoch": epoch,
                        },
                        checkpoint,
                    )
                if step == crash_at:
                    return seen  # the "crash": everything after the last checkpoint is lost
            epoch += 1
        return seen
    finally:
        dl.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = (args.workdir or Path(tmp)) / "ckpt.pt"
        reference = train(checkpoint, crash_at=None, resume=False)
        before_crash = train(checkpoint, crash_at=CRASH_AT, resume=False)
        last_checkpoint = CRASH_AT - CRASH_AT % CHECKPOINT_EVERY
        after_resume = train(checkpoint, crash_at=None, resume=True)
        resumed_run = before_crash[:last_checkpoint] + after_resume
    assert resumed_run == reference, "the resumed run saw other data than the uninterrupted one"
    print(f"crashed at step {CRASH_AT}, resumed from step {last_checkpoint}: {len(resumed_run)} batches, "
          "identical to an uninterrupted run")  # fmt: skip


if __name__ == "__main__":
    main()
