"""export_upstream: the patch series on a torchdata checkout (docs/maintainers.rst).

CI cannot reach torchdata's repository, so the checkout here is a git repository built from the
installed torchdata's package files plus the few top-level files a checkout has; each test
works on a clone of it. The real checkouts (v0.7.1, v0.8.0, v0.9.0) are exercised by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torchdata

from torchdata_snapshot import export_upstream
from torchdata_snapshot.export_upstream import SERIES, ExportError, check_series, export

TAG = "v" + torchdata.__version__.split("+")[0]


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout.strip()


IDENTITY = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "t@t",
}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torchdata 'checkout' at the installed version: its package, version.txt, docs, tests."""
    repo = tmp_path_factory.mktemp("torchdata")
    shutil.copytree(
        Path(torchdata.__file__).parent, repo / "torchdata", ignore=shutil.ignore_patterns("__pycache__")
    )
    (repo / "version.txt").write_text(TAG[1:] + "\n")
    (repo / "docs" / "source").mkdir(parents=True)
    (repo / "docs" / "source" / "index.rst").write_text(
        ".. toctree::\n\n   dataloader2.rst\n   reading_service.rst\n"
    )
    (repo / "test" / "dataloader2").mkdir(parents=True)
    (repo / "test" / "dataloader2" / "test_mprs.py").write_text("# upstream's tests live here\n")
    env = {**os.environ, **IDENTITY}
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "torchdata"], ["tag", TAG]):
        subprocess.run(["git", *command], cwd=repo, check=True, env=env, capture_output=True)
    return repo


@pytest.fixture
def checkout(upstream: Path, tmp_path: Path) -> Path:
    clone = tmp_path / "torchdata"
    subprocess.run(["git", "clone", "-q", str(upstream), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", TAG], cwd=clone, check=True)
    for key, value in (("user.name", "test"), ("user.email", "t@t")):
        git(clone, "config", key, value)
    return clone


def run_in(repo: Path, code: str) -> subprocess.CompletedProcess:
    """Run Python in a process that imports torchdata from ``repo`` (before site-packages)."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def state(repo: Path) -> Dict[str, str]:
    """What a refused or failed export must leave as it was: HEAD, the branches, the work tree."""
    return {
        "head": git(repo, "rev-parse", "HEAD"),
        "branches": git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads"),
        "status": git(repo, "status", "--porcelain"),
    }


def test_the_series_places_every_module_once_after_what_it_imports() -> None:
    check_series()


def test_the_branch_holds_one_commit_per_concern_then_the_switch_and_the_docs(checkout: Path) -> None:
    commits = export(checkout)
    assert git(checkout, "rev-parse", "--abbrev-ref", "HEAD") == "mprs-snapshot"
    assert len(commits) == len(SERIES) + 2
    subjects = git(checkout, "log", "--reverse", "--format=%s", f"{TAG}..mprs-snapshot").splitlines()
    assert subjects[: len(SERIES)] == [commit.title for commit in SERIES]
    assert subjects[-2].startswith("[DataLoader2] Make the checkpointable") and subjects[-1].startswith(
        "[Docs]"
    )
    body = git(checkout, "log", "-1", "--format=%b", commits[0])
    assert f"on torchdata {TAG[1:]}" in body, "every message names the torchdata it was made on"
    added = git(checkout, "diff", "--name-only", f"{TAG}..mprs-snapshot").splitlines()
    assert all(
        path.startswith(("torchdata/dataloader2/", "test/dataloader2/snapshot/", "docs/source/"))
        for path in added
    )
    assert "test/dataloader2/test_mprs.py" not in added, "upstream's own tests are left alone"
    assert not any("torchdata_snapshot" in path for path in added), "no new top-level package"


def test_every_commit_imports_on_its_own(checkout: Path) -> None:
    commits = export(checkout)
    for sha in commits[: len(SERIES)]:
        git(checkout, "checkout", "-q", sha)
        modules = [
            path[: -len(".py")].replace("/", ".")
            for path in git(checkout, "diff-tree", "--no-commit-id", "--name-only", "-r", sha).splitlines()
            if path.startswith("torchdata/") and path.endswith(".py")
        ]
        done = run_in(
            checkout, "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
        )
        assert done.returncode == 0, f"{git(checkout, 'log', '-1', '--format=%s', sha)}:\n{done.stderr}"
    git(checkout, "checkout", "-q", "mprs-snapshot")
    for path in [*checkout.glob("torchdata/**/*.py"), *checkout.glob("test/dataloader2/snapshot/*.py")]:
        text = path.read_text()
        assert "import torchdata_snapshot" not in text and "from torchdata_snapshot" not in text, path


def test_the_exported_tree_runs_dataloader2_with_the_checkpointable_service(checkout: Path) -> None:
    export(checkout)
    module = "torchdata.dataloader2.snapshot_reading_service"
    done = run_in(
        checkout,
        "import torchdata.dataloader2 as d, torchdata\n"
        f"assert torchdata.__file__.startswith({str(checkout)!r})\n"
        f"assert d.MultiProcessingReadingService.__module__ == {module!r}\n"
        "from torchdata.datapipes.iter import IterableWrapper\n"
        "rs = d.MultiProcessingReadingService(num_workers=2, multiprocessing_context='fork')\n"
        "dl = d.DataLoader2(IterableWrapper(range(20)).sharding_filter(), reading_service=rs)\n"
        "it = iter(dl); head = [next(it) for _ in range(7)]; state = dl.state_dict(); rest = list(it)\n"
        "dl.shutdown()\n"
        "again = d.DataLoader2.from_state(state, d.MultiProcessingReadingService(num_workers=2))\n"
        "assert list(again) == rest, 'resumed exactly'\n"
        "again.shutdown()\n",
    )
    assert done.returncode == 0, done.stderr


def test_a_slice_of_the_exported_tests_passes_in_the_exported_tree(checkout: Path) -> None:
    export(checkout)
    tests = checkout / "test" / "dataloader2" / "snapshot"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
            "test_messages.py", "test_checkpoint.py", "test_stateful.py", "test_upstream_semantics.py",
        ],
        cwd=tests, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_the_command_line_refuses_with_a_message_and_exit_code_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "torchdata_snapshot.export_upstream", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "is not a torchdata checkout" in done.stderr


def test_the_command_line_exports(checkout: Path) -> None:
    command = ["-m", "torchdata_snapshot.export_upstream", str(checkout), "--branch", "series"]
    done = subprocess.run(
        [sys.executable, "-W", "ignore", *command], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert f"branch series of {checkout}: {len(SERIES) + 2} commits" in done.stdout


@pytest.mark.parametrize(
    "prepare, match",
    [
        (lambda repo: shutil.rmtree(repo / "torchdata" / "dataloader2"), "is not a torchdata checkout"),
        (lambda repo: shutil.rmtree(repo / ".git"), "is not a git checkout"),
        (lambda repo: (repo / "version.txt").write_text("0.6.0\n"), "0.6.0 is not supported"),
        (lambda repo: (repo / "torchdata" / "__init__.py").write_text("# edited\n"), "is not clean"),
        (lambda repo: git(repo, "branch", "mprs-snapshot"), "already has a branch 'mprs-snapshot'"),
    ],
    ids=["not-torchdata", "not-git", "version", "dirty", "branch-exists"],
)
def test_refusals_change_nothing(checkout: Path, prepare: object, match: str) -> None:
    prepare(checkout)  # type: ignore[operator]
    if (checkout / "version.txt").read_text().startswith("0.6.0"):
        git(checkout, "commit", "-q", "-am", "another version")
    before = state(checkout) if (checkout / ".git").exists() else None
    with pytest.raises(ExportError, match=match):
        export(checkout)
    if before is not None:
        assert state(checkout) == before


def test_a_failure_half_way_puts_the_checkout_back(checkout: Path) -> None:
    init = checkout / "torchdata" / "dataloader2" / "__init__.py"
    init.write_text(
        init.read_text().replace("from torchdata.dataloader2.shuffle_spec import ShuffleSpec\n", "")
    )
    git(checkout, "commit", "-q", "-am", "an __init__ the switch commit cannot edit")
    before = state(checkout)
    with pytest.raises(ExportError, match="does not import ShuffleSpec"):
        export(checkout)
    assert state(checkout) == before, "no branch left behind, same HEAD, clean tree"


def test_it_refuses_to_run_without_this_repositorys_tests(
    monkeypatch: pytest.MonkeyPatch, checkout: Path, tmp_path: Path
) -> None:
    monkeypatch.setattr(export_upstream, "TESTS_DIR", tmp_path / "nowhere")
    with pytest.raises(ExportError, match="from a clone of the torchdata_snapshot repository"):
        export(checkout)
