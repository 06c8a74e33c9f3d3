"""``PR-1.md`` .. ``PR-N.md``: the descriptions of the stack's pull requests, next to the checkout
(not in it): each ``[[pr]]``'s template of ``prs/`` with its commits, its size, where it stands in
the stack and the benchmark table filled in."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

from manifest import PULL_REQUESTS_DIR, REPO_DIR, Manifest
from series import _git, pull_request_commits, stack_branches

README = REPO_DIR / "README.md"
MARKER = "<!-- benchmark-table:begin -->"


def benchmark_table() -> str:
    """The README's latest throughput table (the line saying where and when it was measured,
    and the table), with "ours" named as the pull request names it."""
    text = README.read_text()
    if MARKER not in text:
        return "(no benchmark run recorded)"
    block = text.split(MARKER, 1)[1].strip().split("\n\n")
    table = "\n\n".join(block[:2])
    return table.replace("ours items/s", "new MPRS items/s").replace("| ours/", "| new/")


def _listing(checkout: Path, commits: Sequence[str]) -> str:
    lines = []
    for i, sha in enumerate(commits, 1):
        subject = _git(checkout, "log", "-1", "--format=%s", sha)
        size = _git(checkout, "diff", "--shortstat", f"{sha}^", sha).strip()
        lines.append(f"{i}. {subject} ({size})")
    return "\n".join(lines)


def _tests(checkout: Path, commits: Sequence[str]) -> str:
    """The test files ``commits`` add or change that still exist at their tip, for a test plan."""
    names = _git(checkout, "diff", "--name-only", "--diff-filter=AM", f"{commits[0]}^", commits[-1])
    tests = [p for p in names.splitlines() if p.startswith("test/") and Path(p).name.startswith("test_")]
    return " \\\n    ".join(tests) or "test/dataloader2"


def write_pull_requests(checkout: Path, branch: str, commits: List[str], manifest: Manifest) -> List[Path]:
    """Write ``PR-k.md`` beside ``checkout`` for each pull request of the stack; their paths."""
    prs = manifest.pull_requests
    names = stack_branches(branch, len(prs))
    base = _git(checkout, "rev-parse", f"{commits[0]}^")
    stack = "\n".join(f"{k}. {pr.title} (`{name}`)" for k, (pr, name) in enumerate(zip(prs, names), 1))
    written = []
    for k, (pr, name, mine) in enumerate(zip(prs, names, pull_request_commits(commits, manifest)), 1):
        below = names[k - 2] if k > 1 else _git(checkout, "describe", "--tags", "--always", base)
        size = _git(checkout, "diff", "--shortstat", f"{mine[0]}^", mine[-1]).strip()
        following = (
            f"PR {k + 1}: {prs[k].title}"
            if k < len(prs)
            else "nothing: this is the stack's last pull request"
        )
        replacements = {
            "{{TITLE}}": pr.title,
            "{{BRANCH}}": name,
            "{{BASE}}": below,
            "{{COUNT}}": str(len(mine)),
            "{{SIZE}}": size,
            "{{COMMITS}}": _listing(checkout, mine),
            "{{STACK}}": stack,
            "{{NEXT}}": following,
            "{{BENCHMARKS}}": benchmark_table(),
            "{{SUMMARY}}": pr.summary.strip(),
            "{{TESTS}}": _tests(checkout, mine),
        }
        text = (PULL_REQUESTS_DIR / pr.description).read_text()
        for placeholder, value in replacements.items():
            text = text.replace(placeholder, value)
        out = checkout.parent / f"PR-{k}.md"
        out.write_text(text)
        written.append(out)
    return written
