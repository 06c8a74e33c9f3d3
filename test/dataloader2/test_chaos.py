"""The chaos runs of scripts/chaos.py, short: workers SIGKILLed at random moments under a running
job with self-healing, and training processes SIGKILLed and resumed from their checkpoints; the
data is exactly that of an uninterrupted run. CI's workflow and scripts/chaos.sh run them long."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pipelines import CONTEXT, TENSOR_POOL

CHAOS = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def chaos(*args: str) -> str:
    """Run the script under the suite's start method (and tensor pool: ``pytest --tensor-pool`` or
    ``--no-tensor-pool``; without either, the reading service's default)."""
    pool = {True: ["--tensor-pool"], False: ["--no-tensor-pool"], None: []}[TENSOR_POOL]
    done = subprocess.run(
        [sys.executable, str(CHAOS), *args, "--start-method", CONTEXT, *pool],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"chaos failed:\n{done.stdout}\n{done.stderr}"
    assert "chaos: passed" in done.stdout
    assert ("tensor pool" in done.stdout.splitlines()[0]) is (TENSOR_POOL is True)
    return done.stdout


@pytest.mark.parametrize("seed", [1, 2])
def test_workers_killed_at_random_moments_are_healed_with_exact_data(seed: int) -> None:
    out = chaos(
        "workers", "--epochs", "3", "--items", "1200", "--workers", "4", "--kills", "8", "--seed", str(seed)
    )
    counts = re.search(r"(\d+) workers SIGKILLed .* (\d+) restarted", out)
    assert counts is not None and int(counts[1]) == int(counts[2]) == 8, out
    assert re.search(r"workers: \d+ batches compared with the uninterrupted run, mismatches: 0", out)


def test_training_processes_killed_at_random_steps_resume_with_exact_data() -> None:
    out = chaos(
        "restarts", "--epochs", "2", "--items", "400", "--workers", "2", "--cycles", "3",
        "--checkpoint-every", "5", "--seed", "3",
    )  # fmt: skip
    assert re.search(r"restarts: [1-3] training processes SIGKILLed", out)
    assert re.search(r"restarts: \d+ batches compared with the uninterrupted run, mismatches: 0", out)
