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


def test_resume_demo() -> None:
    out = run_example("resume_demo.py", "--items", "400", "--workers", "2", "--checkpoint-every", "7")
    assert "exit code -9" in out
    assert "workers exited on their own: True" in out
    assert "identical to the uninterrupted run, batch for batch: nothing lost, nothing duplicated" in out


def test_quickstart() -> None:
    out = run_example("quickstart.py")
    assert "identical to an uninterrupted run" in out


def test_the_design_diagrams_are_up_to_date() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES.parent / "docs" / "diagrams" / "make_diagrams.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout
