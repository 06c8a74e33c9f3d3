"""Check a series as upstream's reviewers and CI would: its shape (count, size, tests in every
commit, no trace of the add-on), upstream's pinned linters on what it changes, every changed
module importable at every commit, and upstream's ``test/dataloader2`` at chosen commits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from manifest import PACKAGE
from py39 import runtime_problems, syntax_problems
from series import _git

#: Files the series must change in place (the RFC's messages, worker loop and reading service).
IN_PLACE = (
    "torchdata/dataloader2/communication/messages.py",
    "torchdata/dataloader2/utils/worker.py",
    "torchdata/dataloader2/reading_service.py",
)
MIN_COMMITS = 15
#: The first pull request, the snapshot RFC, is reviewed as one piece: one commit's worth of lines.
RFC_MAX_LINES = 800

#: The pytest plugin that makes spawn the default start method (macOS's and Windows'), by module name.
SPAWN_PLUGIN = "spawn_start"
HERE = Path(__file__).resolve().parent

#: Upstream's flake8 settings (its .flake8), for a checkout that lacks the file.
FLAKE8_DEFAULTS = [
    "--max-line-length=120",
    "--ignore=E203,E402,E501,F821,W503,W504",
    "--per-file-ignores=__init__.py:F401,F403,F405 test/*:F401 _extension.py:F401",
]


@dataclass
class Report:
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.problems.append(message)

    def note(self, message: str) -> None:
        self.notes.append(message)

    def print(self) -> int:
        """Print the notes and the problems; the exit code (1 if any problem)."""
        for note in self.notes:
            print(f"ok: {note}")
        for problem in self.problems:
            print(f"FAIL: {problem}")
        return 1 if self.problems else 0


def commits_of(checkout: Path, base: str, branch: str) -> List[str]:
    return _git(checkout, "rev-list", "--reverse", f"{base}..{branch}").split()


def changed_lines(checkout: Path, sha: str) -> int:
    total = 0
    for line in _git(checkout, "diff", "--numstat", f"{sha}^", sha).splitlines():
        added, deleted, _ = line.split("\t", 2)
        total += int(added) + int(deleted) if added != "-" else 0
    return total


def only_deletes(checkout: Path, sha: str) -> bool:
    """Whether commit ``sha`` only deletes code of torchdata/ (files, and the imports of them): what
    nothing runs any more needs no test of its own; the tests of what remains must pass."""
    diff = _git(checkout, "diff", "-U0", f"{sha}^", sha, "--", "torchdata")
    added = [
        line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
    ]
    return all(line.startswith(("from ", "import ")) or not line for line in added)


def check_shape(checkout: Path, base: str, branch: str, max_lines: int, report: Report) -> None:
    commits = commits_of(checkout, base, branch)
    if len(commits) < MIN_COMMITS:
        report.fail(f"{len(commits)} commits, fewer than {MIN_COMMITS}")
    for sha in commits:
        title = _git(checkout, "log", "-1", "--format=%s", sha)
        size = changed_lines(checkout, sha)
        if size > max_lines:
            report.fail(f"{title}: {size} changed lines, more than {max_lines}")
        paths = _git(checkout, "diff", "--name-only", f"{sha}^", sha).splitlines()
        tested = any(p.startswith("test/") for p in paths) or only_deletes(checkout, sha)
        if any(p.startswith("torchdata/") for p in paths) and not tested:
            report.fail(f"{title}: changes torchdata/ without a test")
    diff = _git(checkout, "diff", f"{base}..{branch}")
    messages = _git(checkout, "log", "--format=%B", f"{base}..{branch}")
    for trace in (PACKAGE, PACKAGE.upper()):
        if re.search(trace, diff, re.I) or re.search(trace, messages, re.I):
            report.fail(f"{trace!r} appears in the diff or the commit messages")
    changed = set(_git(checkout, "diff", "--name-only", f"{base}..{branch}").splitlines())
    for path in IN_PLACE:
        if path not in changed:
            report.fail(f"{path} is not changed in place")
    classes = _git(
        checkout, "grep", "-c", "^class MultiProcessingReadingService", branch, "--", "torchdata", check=False
    )
    if sum(int(line.rsplit(":", 1)[1]) for line in classes.splitlines() if line) != 1:
        report.fail(f"not exactly one MultiProcessingReadingService class: {classes!r}")
    report.note(
        f"{len(commits)} commits, largest {max(changed_lines(checkout, c) for c in commits)} changed lines"
    )


def check_stack(checkout: Path, base: str, stack: Sequence[str], max_pr_lines: int, report: Report) -> None:
    """Each pull request of the stack (``NAME-1`` .. ``NAME-N``, each on the one before) within
    ``max_pr_lines`` changed lines; the first, the RFC, within ``RFC_MAX_LINES``."""
    below = base
    for k, name in enumerate(stack, 1):
        if subprocess.run(["git", "merge-base", "--is-ancestor", below, name], cwd=checkout).returncode:
            report.fail(f"{name} is not on top of {below}")
        mine = commits_of(checkout, below, name)
        size = sum(changed_lines(checkout, sha) for sha in mine)
        limit = RFC_MAX_LINES if k == 1 else max_pr_lines
        if size > limit:
            report.fail(f"pull request {k} ({name}): {size} changed lines, more than {limit}")
        report.note(f"pull request {k} ({name}): {len(mine)} commits, {size} changed lines")
        below = name


def _run(
    command: Sequence[str], cwd: Path, env: Optional[dict] = None, timeout: float = 3600
) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)


def check_lint(checkout: Path, base: str, branch: str, tools: Path, report: Report) -> None:
    """ufmt and flake8 on the Python files the series changes, and mypy (:func:`check_mypy`)."""
    _git(checkout, "checkout", "-q", branch)
    files = [
        p
        for p in _git(checkout, "diff", "--name-only", "--diff-filter=AM", f"{base}..{branch}").splitlines()
        if p.endswith(".py")
    ]
    done = _run([str(tools / "ufmt"), "check", *files], checkout)
    if done.returncode:
        report.fail(f"ufmt check: {(done.stdout + done.stderr).strip()[-2000:]}")
    flake8 = [str(tools / "flake8")] + ([] if (checkout / ".flake8").is_file() else FLAKE8_DEFAULTS)
    done = _run([*flake8, *files], checkout)
    if done.returncode:
        report.fail(f"flake8: {done.stdout.strip()[-2000:]}")
    check_mypy(checkout, files, tools, report)


def check_mypy(checkout: Path, files: Sequence[str], tools: Path, report: Report) -> None:
    """mypy with the checkout's mypy.ini, as checked out, counting only errors in ``files`` (the
    base has its own, and a newer torch than upstream's CI pinned needs ``--python-version 3.10``
    to be parsed); nothing without a mypy.ini."""
    if not (checkout / "mypy.ini").is_file():
        report.note("mypy: not run, the checkout has no mypy.ini")
        return
    done = _run([str(tools / "mypy"), "--python-version", "3.10"], checkout)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    ours = [line for line in errors if line.split(":", 1)[0] in files]
    if ours:
        report.fail("mypy: " + "\n".join(ours[:30]))
    report.note(f"mypy: {len(ours)} errors in the series' files")


def check_imports(checkout: Path, base: str, branch: str, python: str, report: Report) -> None:
    """At every commit, every Python module of torchdata it changes imports in a fresh process."""
    for sha in commits_of(checkout, base, branch):
        _git(checkout, "checkout", "-q", sha)
        paths = _git(checkout, "diff", "--name-only", "--diff-filter=AM", f"{sha}^", sha).splitlines()
        modules = [
            p[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            for p in paths
            if p.startswith("torchdata/") and p.endswith(".py")
        ]
        if not modules:
            continue
        code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
        done = _run(
            [python, "-W", "ignore", "-c", code],
            checkout,
            env={**os.environ, "PYTHONPATH": str(checkout)},
            timeout=300,
        )
        if done.returncode:
            title = _git(checkout, "log", "-1", "--format=%s", sha)
            report.fail(f"{title}: import fails: {done.stderr.strip()[-1500:]}")
    _git(checkout, "checkout", "-q", branch)


def check_tests(
    checkout: Path, base: str, branch: str, python: str, which: Sequence[str], report: Report
) -> None:
    """``pytest test/dataloader2`` at the ``first``, ``middle`` and ``tip`` commits, or at the tip of
    a pull request of the stack (``pr1`` .. ``prN``: the branches ``BRANCH-1`` ..), as asked."""
    commits = commits_of(checkout, base, branch)
    chosen = {"first": commits[0], "middle": commits[len(commits) // 2], "tip": commits[-1]}
    for name in which:
        if name.startswith("pr"):
            chosen[name] = _git(checkout, "rev-parse", f"{branch}-{name[2:]}")
    for name in which:
        sha = chosen[name]
        _git(checkout, "checkout", "-q", sha)
        done = _run(
            [python, "-m", "pytest", "test/dataloader2", "-q", "-p", "no:cacheprovider", "-W", "ignore"],
            checkout,
            env={**os.environ, "PYTHONPATH": str(checkout)},
        )
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        title = _git(checkout, "log", "-1", "--format=%s", sha)
        if done.returncode:
            report.fail(f"test/dataloader2 at the {name} commit ({title}): {summary}\n{done.stdout[-3000:]}")
        else:
            report.note(f"test/dataloader2 at the {name} commit ({title}): {summary}")
    _git(checkout, "checkout", "-q", branch)


def collection_errors(checkout: Path, sha: str) -> Tuple[List[str], List[str]]:
    """Upstream CI's own command, ``pytest test``, collecting only at ``sha``: the files that fail
    to collect, and the warnings about unknown marks."""
    _git(checkout, "checkout", "-q", sha)
    done = _run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "test"],
        checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        timeout=900,
    )
    output = done.stdout + done.stderr
    errors = sorted(set(re.findall(r"^ERROR (\S+)", output, re.MULTILINE)))
    return errors, sorted(set(re.findall(r"PytestUnknownMarkWarning: (Unknown pytest\.mark\.\w+)", output)))


def check_collection(checkout: Path, base: str, tips: Sequence[str], report: Report) -> None:
    """At each of ``tips``, ``pytest test`` collects with no error the base does not have and
    knows every mark (a test file named as one of upstream's fails here: torchdata's test
    folders are not packages)."""
    before, _ = collection_errors(checkout, base)
    for tip in tips:
        errors, marks = collection_errors(checkout, tip)
        new = [e for e in errors if e not in before]
        if new or marks:
            report.fail(f"pytest --collect-only test at {tip}: new errors {new}, {marks}")
        else:
            report.note(f"pytest --collect-only test at {tip}: no error the base lacks ({len(before)} there)")
    _git(checkout, "checkout", "-q", tips[-1] if tips else base)


def check_python39(checkout: Path, base: str, tip: str, report: Report) -> None:
    """Every Python file the series adds or changes up to ``tip`` parses under Python 3.9 and
    uses nothing 3.9 lacks at run time (upstream's CI runs 3.9 to 3.12)."""
    _git(checkout, "checkout", "-q", tip)
    files = [
        checkout / p
        for p in _git(checkout, "diff", "--name-only", "--diff-filter=AM", f"{base}..{tip}").splitlines()
        if p.endswith(".py")
    ]
    problems = syntax_problems(files)
    for path in files:
        problems += runtime_problems(path.read_text(), str(path.relative_to(checkout)))
    if problems:
        report.fail("Python 3.9: " + "\n".join(problems[:30]))
    report.note(f"Python 3.9: {len(files)} files checked at {tip}")


def check_spawned_tests(checkout: Path, tips: Sequence[str], report: Report) -> None:
    """``pytest test/dataloader2`` at each of ``tips`` with spawn as the default start method."""
    for tip in tips:
        _git(checkout, "checkout", "-q", tip)
        done = _run(
            [
                sys.executable,
                "-m",
                "pytest",
                "test/dataloader2",
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore",
            ]
            + ["-p", SPAWN_PLUGIN],
            checkout,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(HERE)])},
        )
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        if done.returncode:
            report.fail(f"test/dataloader2 under spawn at {tip}: {summary}\n{done.stdout[-3000:]}")
        else:
            report.note(f"test/dataloader2 under spawn at {tip}: {summary}")


def check_all(
    checkout: Path,
    base: str,
    branch: str,
    max_lines: int,
    tools: Optional[Path],
    which: Sequence[str],
    stack: Sequence[str] = (),
    max_pr_lines: int = 3000,
) -> Report:
    """Every check: the shape (of the stack's pull requests too), imports at every commit, the
    linters at each pull request's tip (with ``tools``), and ``test/dataloader2`` at the commits
    ``which`` names."""
    report = Report()
    check_shape(checkout, base, branch, max_lines, report)
    if stack:
        check_stack(checkout, base, stack, max_pr_lines, report)
    check_imports(checkout, base, branch, sys.executable, report)
    if tools is not None:
        for tip in stack or [branch]:
            check_lint(checkout, base, tip, tools, report)
    if which:
        check_tests(checkout, base, branch, sys.executable, which, report)
    # The heavy checks, at the RFC's tip and the stack's: what upstream's CI runs on every platform.
    ends = list(dict.fromkeys([stack[0], stack[-1]] if stack else [branch]))
    check_collection(checkout, base, ends, report)
    for tip in ends:
        check_python39(checkout, base, tip, report)
    check_spawned_tests(checkout, ends, report)
    _git(checkout, "checkout", "-q", branch)
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python tools/export_upstream/check.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--base", required=True, help="the tag the series starts from, e.g. v0.9.0")
    parser.add_argument("--branch", default="mprs-snapshot")
    parser.add_argument("--tools", type=Path, help="folder with ufmt, flake8 and mypy as upstream pins them")
    parser.add_argument(
        "--tests", default="first,middle,tip", help="commits at which to run test/dataloader2 ('' for none)"
    )
    parser.add_argument("--max-lines", type=int, default=800)
    args = parser.parse_args(argv)
    which = [w for w in args.tests.split(",") if w]
    report = check_all(args.checkout.resolve(), args.base, args.branch, args.max_lines, args.tools, which)
    return report.print()


if __name__ == "__main__":
    sys.exit(main())
