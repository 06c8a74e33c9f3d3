"""Every script in examples/ runs (small sizes) in a fresh process and checks its own result."""

from __future__ import annotations

import inspect
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

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


def training_process(workdir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / "preemption.py"), "train", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job step
    )


@pytest.mark.parametrize(
    "target, at_step",
    [("training process", 30), ("process group", 100)],  # mid-epoch; about the first epoch's end
)
def test_preemption_saves_at_the_end_of_the_step_and_resumes_exactly(
    tmp_path: Path, target: str, at_step: int
) -> None:
    run_example("preemption.py", "reference", "--workdir", str(tmp_path))
    with training_process(tmp_path) as process:
        try:
            assert process.stdout is not None
            lines = []
            for line in process.stdout:
                lines.append(line.strip())
                if line == f"step {at_step}\n":
                    if target == "process group":  # SLURM: every process of the job, workers too
                        os.killpg(process.pid, signal.SIGTERM)
                    else:  # Kubernetes: the container's main process
                        process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0, lines[-5:]
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    saved_at = int(lines[-1].removeprefix("preempted: saved at step ").removesuffix(", exiting"))
    # (The process runs ahead of what this test has read: the signal lands at a later step.)
    assert saved_at >= at_step and lines[-2] == f"step {saved_at}", (
        "the step in progress finishes, then it saves"
    )
    assert not (tmp_path / "done.pkl").exists()

    with training_process(tmp_path) as resumed:
        out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0
    assert out.split()[1] == str(saved_at + 1), "the resumed job continues at the next step"
    seen, weight = pickle.loads((tmp_path / "done.pkl").read_bytes())
    expected, expected_weight = pickle.loads((tmp_path / "reference.pkl").read_bytes())
    assert seen == expected and weight == expected_weight


def test_preemption_demo() -> None:
    out = run_example("preemption.py", "--group", "--preempt-at", "40")
    assert "identical to the run that was never preempted" in out


def torchrun(nproc: int, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*command, str(EXAMPLES / "elastic_resume.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_elastic_resume_kills_a_2_rank_job_and_resumes_it_with_3(tmp_path: Path) -> None:
    killed = torchrun(2, "--dir", str(tmp_path), "--kill-at", "5")
    assert killed.returncode == 0, f"a deliberate preemption ends cleanly:\n{killed.stdout}\n{killed.stderr}"
    assert "preempted on purpose at step 5: every rank saved its state" in killed.stdout
    assert "ChildFailedError" not in killed.stderr and "Traceback" not in killed.stderr
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    resumed = torchrun(3, "--dir", str(tmp_path))
    assert resumed.returncode == 0, f"{resumed.stdout}\n{resumed.stderr}"
    assert (
        "exactly once: 1200 elements (40 by 2 ranks before the kill, 1160 by 3 ranks after)" in resumed.stdout
    )


def test_every_exception_has_the_troubleshooting_entry_its_messages_name() -> None:
    from torchdata_snapshot import _errors

    page = (EXAMPLES.parent / _errors.TROUBLESHOOTING).read_text()
    for name in _errors.__all__:
        anchor = str(getattr(_errors, name)("x")).rsplit("#", 1)[1].rstrip(")")
        assert anchor == name.lower()
        assert f"\n.. _{anchor}:\n\n{name}\n{'~' * len(name)}\n" in page, f"no entry for {name}"


def described_parameters(docstring: str) -> List[str]:
    """The names a Google-style docstring describes in its ``Args:`` (and, for a dataclass, its
    ``Attributes:``) sections, once per description."""
    names: List[str] = []
    lines = inspect.cleandoc(docstring).splitlines()
    for i, line in enumerate(lines):
        if line.strip() not in ("Args:", "Attributes:"):
            continue
        indent = None
        for entry in lines[i + 1 :]:
            if entry and not entry.startswith(" "):
                break
            m = re.match(r"( +)(\w+)(?: \(.*\))?: ", entry)
            if m and (indent is None or len(m[1]) == indent):
                indent = len(m[1])
                names.append(m[2])
    return names


def test_the_api_reference_describes_each_parameter_once() -> None:
    """docs/api.rst documents the public names with autodoc, types merged into the parameters
    the docstring describes: each parameter must be described, once, in ``Args:`` (a
    ``Keyword Args:`` section would list the keyword-only ones a second time)."""
    import torchdata_snapshot

    for name in torchdata_snapshot.__all__:
        obj = getattr(torchdata_snapshot, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            continue
        doc = inspect.getdoc(obj) or ""
        assert "Keyword Args:" not in doc, name
        parameters = [p for p in inspect.signature(obj).parameters if p != "self"]
        described = described_parameters(obj.__doc__ or "")
        assert sorted(described) == sorted(parameters), name


def test_the_quickstarts_lines_are_those_of_its_example() -> None:
    """The quickstart page shows the lines that matter of examples/quickstart.py (which runs
    above): each of them is a line of the script, so that the page cannot drift from it."""
    page = (EXAMPLES.parent / "docs" / "quickstart.rst").read_text()
    block = page.split("from ``examples/quickstart.py``:\n\n.. code-block:: python\n\n", 1)[1]
    code = [line.strip() for line in block.split("\n\n``python examples/quickstart.py``", 1)[0].splitlines()]
    script = {line.strip() for line in (EXAMPLES / "quickstart.py").read_text().splitlines()}
    shown = [line for line in code if line and not line.startswith("#")]
    assert len(shown) >= 10
    assert [line for line in shown if line not in script] == []


def test_the_examples_resume_as_the_readme_recommends() -> None:
    """With ``torchdata_snapshot.load_state_dict`` into the pipeline the code builds (the README's
    advice), not ``DataLoader2.from_state``, which restores the pipeline pickled in the state."""
    for path in sorted(EXAMPLES.glob("*.py")):
        source = path.read_text()
        assert "DataLoader2.from_state(" not in source, path.name
        if "state_dict()" in source and "torch.load(" in source:
            assert "load_state_dict(dl, " in source, path.name
