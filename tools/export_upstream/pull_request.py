"""``PR.md``: the pull request's description, next to the checkout (not in it): the template
``PR.md`` of this folder with the series' commits and the benchmark table filled in."""

from __future__ import annotations

from pathlib import Path
from typing import List

from manifest import REPO_DIR
from series import PR_TEMPLATE, _git

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


def write_pull_request(checkout: Path, branch: str, commits: List[str]) -> Path:
    """Write ``PR.md`` beside ``checkout``; its path."""
    lines = []
    for i, sha in enumerate(commits, 1):
        subject = _git(checkout, "log", "-1", "--format=%s", sha)
        size = _git(checkout, "diff", "--shortstat", f"{sha}^", sha).strip()
        lines.append(f"{i}. {subject} ({size})")
    listing = "\n".join(lines)
    text = PR_TEMPLATE.read_text()
    text = text.replace("{{COMMITS}}", listing).replace("{{BENCHMARKS}}", benchmark_table())
    text = text.replace("{{BRANCH}}", branch).replace("{{COUNT}}", str(len(commits)))
    out = checkout.parent / "PR.md"
    out.write_text(text)
    return out
