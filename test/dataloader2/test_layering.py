"""The package's modules import one another only downward: no import cycle, so that each module
can be read (and replaced) knowing only the ones below it (see the docs' design page)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[2] / "torchdata_snapshot"


def imports() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        module = path.stem
        found: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("torchdata_snapshot")
            ):
                if node.module == "torchdata_snapshot":
                    found.update(alias.name for alias in node.names)
                else:
                    found.add(node.module.rsplit(".", 1)[-1])
        graph[module] = found - {module}
    return graph


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph = imports()
    done: Set[str] = set()

    def visit(module: str, path: List[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join([*path, module])}"
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])
    assert "_reading_service" not in set().union(*(graph[m] for m in graph if m != "__init__")), (
        "only the package's __init__ imports the reading service"
    )
