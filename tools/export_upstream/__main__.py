"""Export the package as a patch series on a torchdata checkout, for review as a pull request.

    python tools/export_upstream PATH/TO/torchdata [--branch NAME] [--tools DIR] [--check]

On a clean git checkout of torchdata 0.7.1, 0.8.x or 0.9.x this creates the branch ``NAME``
(default ``mprs-snapshot``): small commits that change upstream's files where the feature lives
(``communication/messages.py``, ``utils/worker.py``, ``reading_service.py``) and add the rest
beside them, each with its tests under ``test/dataloader2/snapshot/``, formatted as upstream's
pre-commit formats; then ``PR.md`` in the checkout's parent folder describes the pull request.
``series.toml`` says which module goes where and in which commit. A checkout that cannot take
the series is refused before anything changes; a failure half-way puts it back as it was.
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
from pull_request import write_pull_request  # noqa: E402
from series import _git, export, find_tools  # noqa: E402


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
        help="then check the series: its shape, upstream's linters, imports at every commit, and "
        "test/dataloader2 at the first, middle and last commits",
    )
    args = parser.parse_args(argv)
    try:
        commits = export(args.checkout, args.branch, args.tools)
        pr = write_pull_request(args.checkout.resolve(), args.branch, commits)
    except ExportError as e:
        print(f"export_upstream: {e}", file=sys.stderr)
        return 2
    print(f"branch {args.branch} of {args.checkout}: {len(commits)} commits")
    for sha in commits:
        print(" ", _git(args.checkout.resolve(), "log", "-1", "--format=%h %s", sha))
    print(f"pull request description: {pr}")
    print(f"patch files: git -C {args.checkout} format-patch <the tag>..{args.branch}")
    if not args.check:
        return 0
    checkout = args.checkout.resolve()
    base = _git(checkout, "rev-parse", f"{commits[0]}^")
    max_lines = manifest_module.load().max_changed_lines
    tools = args.tools or find_tools(None)
    return check.check_all(checkout, base, args.branch, max_lines, tools, ("first", "middle", "tip")).print()


if __name__ == "__main__":
    sys.exit(main())
