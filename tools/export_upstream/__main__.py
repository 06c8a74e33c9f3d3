"""Export the package as a patch series on a torchdata checkout, for review as a pull request.

    python tools/export_upstream PATH/TO/torchdata [--branch NAME] [--tools DIR] [--check]

On a clean git checkout of torchdata 0.7.1, 0.8.x or 0.9.x this creates a stack of pull
requests: the branches ``NAME-1`` .. ``NAME-N`` (default name ``mprs-snapshot``), each on top of
the one before, and ``NAME`` at the stack's tip. Small commits change upstream's files where the
feature lives (``communication/messages.py``, ``utils/worker.py``, ``reading_service.py``) and
add the rest beside them, each with its tests, formatted as upstream's pre-commit formats; the
first pull request is the snapshot RFC on upstream's own loop. ``PR-1.md`` .. ``PR-N.md`` in the
checkout's parent folder describe the pull requests. ``series.toml`` says which module goes
where, in which commit and which pull request. A checkout that cannot take the series is
refused before anything changes; a failure half-way puts it back as it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import check  # noqa: E402
import manifest as manifest_module  # noqa: E402
from errors import ExportError  # noqa: E402
from pull_request import write_pull_requests  # noqa: E402
from series import _git, export, find_tools, stack_branches  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/export_upstream", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkout", type=Path, help="a git checkout of torchdata (v0.7.1, v0.8.0 or v0.9.0)")
    parser.add_argument(
        "--branch", default="mprs-snapshot", help="the branch to create (default: mprs-snapshot)"
    )
    parser.add_argument(
        "--tools",
        type=Path,
        help="folder with upstream's pinned pyupgrade, ufmt, flake8 and mypy (default: where ufmt is "
        "on PATH); see requirements-upstream-lint.txt",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="then check the series: its shape and its pull requests' sizes, imports at every "
        "commit, upstream's linters at each pull request's tip, and test/dataloader2 at the first "
        "commit and at each pull request's tip",
    )
    args = parser.parse_args(argv)
    manifest = manifest_module.load()
    try:
        commits = export(args.checkout, args.branch, args.tools, manifest)
        descriptions = write_pull_requests(args.checkout.resolve(), args.branch, commits, manifest)
    except ExportError as e:
        print(f"export_upstream: {e}", file=sys.stderr)
        return 2
    checkout = args.checkout.resolve()
    stack = stack_branches(args.branch, len(manifest.pull_requests))
    print(f"a stack of {len(stack)} pull requests on {args.checkout}: {len(commits)} commits")
    for name, description in zip(stack, descriptions):
        print(f"  {name}: {description}")
    for sha in commits:
        print(" ", _git(checkout, "log", "-1", "--format=%h %s", sha))
    ranges = ", ".join(f"{a}..{b}" for a, b in zip(["<the tag>", *stack], stack))
    print(f"patch files: git -C {args.checkout} format-patch RANGE, for each of {ranges}")
    if not args.check:
        return 0
    base = _git(checkout, "rev-parse", f"{commits[0]}^")
    tools = args.tools or find_tools(None)
    which = ("first", *(f"pr{k}" for k in range(1, len(stack) + 1)))
    report = check.check_all(
        checkout,
        base,
        args.branch,
        manifest.max_changed_lines,
        tools,
        which,
        stack,
        manifest.max_pull_request_lines,
    )
    return report.print()


if __name__ == "__main__":
    sys.exit(main())
