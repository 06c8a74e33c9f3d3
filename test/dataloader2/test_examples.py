"""Every script in examples/ runs (small sizes) in a fresh process and checks its own result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str, timeout_s: float = 180) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_snapshot_demo() -> None:
    out = run_example("snapshot_demo.py", "--items", "200", "--every", "50")
    assert out.count("after ") == 4
    assert "200 items, identical to a run without snapshots." in out
