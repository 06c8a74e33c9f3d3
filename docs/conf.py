"""Sphinx configuration: ``scripts/docs.sh`` builds the site with warnings as errors."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=r"(?s).*'dataloader2' modules are deprecated")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "torchdata_snapshot"
author = "torchdata_snapshot maintainers"
copyright = "2026, torchdata_snapshot maintainers"
from torchdata_snapshot import __version__ as release  # noqa: E402

version = release

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
templates_path: list = []
exclude_patterns = ["_build", "upstream"]  # upstream/: pages written for torchdata's docs
html_theme = "alabaster"
html_static_path: list = []
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Types join the parameters a docstring describes, so that each parameter is listed once, with
# its type and its description (not a list of types, then one of descriptions).
autodoc_typehints_description_target = "documented_params"
napoleon_google_docstring = True
nitpicky = True
# Types of torch and torchdata (no network for intersphinx here) and typing internals.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|torchdata|multiprocessing|collections|typing)\..*"),
    (r"py:.*", r"(DataPipe|DataLoader2|SeedGenerator|WorkerInfo|BatchingOptions|Checkpoint|Mark)"),
    (r"py:.*", r"(GraphState|T|Any)"),
    (r"py:.*", r"(Callable|Optional|Dict|List|Tuple|Sequence|Iterator|Iterable|Deque|Type)"),
    (r"py:class", r"(torchdata_snapshot\..*|upstream\..*)"),
]


def _benchmark_table() -> None:
    """Turn the latest benchmark tables (Markdown, written by benchmarks/run.py) into RST."""
    source = ROOT / "benchmarks" / "results" / "latest.md"
    target = Path(__file__).resolve().parent / "_generated" / "benchmarks.rst"
    target.parent.mkdir(exist_ok=True)
    out, table = [], []

    def flush() -> None:
        if not table:
            return
        rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table]
        rows = [row for row in rows if not all(set(cell) <= set("-:") for cell in row)]
        out.append(".. list-table::\n   :header-rows: 1\n")
        for row in rows:
            out.append("   * - " + "\n     - ".join(cell.replace("`", "``") or " " for cell in row))
        out.append("")
        table.clear()

    for line in source.read_text().splitlines() if source.exists() else ["(no benchmark results yet)"]:
        if line.startswith("|"):
            table.append(line)
        else:
            flush()
            out.append(line.replace("`", "``"))
    flush()
    target.write_text("\n".join(out) + "\n")


_benchmark_table()
