"""The package's modules import one another only downward: no import cycle, so that each module
can be read (and replaced) knowing only the ones below it (see the docs' design page)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set

PACKAGE = Path(__file__).resolve().parents[2] / "torchdata_snapshot"
DIAGRAMS = PACKAGE.parent / "docs" / "diagrams" / "make_diagrams.py"


def _diagrams() -> Any:
    spec = importlib.util.spec_from_file_location("make_diagrams", DIAGRAMS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_name(path: Path) -> str:
    """``core/main/outlet.py`` -> ``core.main.outlet``; a folder's ``__init__.py`` -> the folder."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _run_time_imports(tree: ast.AST) -> Iterator[ast.ImportFrom]:
    """The ``from ... import`` statements of ``tree`` that run: not those under ``if TYPE_CHECKING``
    (annotations name types of modules above, as an interface the core owns must)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from _run_time_imports(ast.Module(body=node.orelse, type_ignores=[]))
            continue
        if isinstance(node, ast.ImportFrom):
            yield node
        yield from _run_time_imports(node)


def imports() -> Dict[str, Set[str]]:
    """Each module -> the package's modules it imports (wherever in the module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        found: Set[str] = set()
        for node in _run_time_imports(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("torchdata_snapshot")
            ):
                continue
            inside = node.module[len("torchdata_snapshot.") :]
            for alias in node.names:
                named = f"{inside}.{alias.name}" if inside else alias.name
                found.add(named if named in modules else inside or "__init__")
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
    above = {"__init__", "checkpoint.load_state"}  # load_state_dict loads into the service's DataLoader2
    assert "core.reading_service" not in set().union(*(graph[m] for m in graph if m not in above)), (
        "only the package's __init__ and load_state_dict import the reading service"
    )


#: The optional features' folders: nothing outside a feature's folder imports it (the package's
#: ``__init__`` imports each one by name to install it).
OPTIONAL = ("elastic", "healing", "tensor_pool")


def test_the_core_and_the_checkpoint_import_no_optional_folder() -> None:
    graph = imports()
    for module, imported in graph.items():
        if module == "__init__":
            continue
        home = module.split(".")[0]
        foreign = sorted(m for m in imported if m.split(".")[0] in OPTIONAL and m.split(".")[0] != home)
        assert not foreign, f"{module} imports the optional {foreign}: plug it in (core.plugins)"


#: The layers, bottom first, as the docs' design page draws them (``docs/diagrams/make_diagrams.py``):
#: a module imports only modules of its own layer or of layers below. A module is in the layer
#: of the longest prefix listed.
LAYERS = tuple((name, parts) for name, parts, _ in _diagrams().LAYERS[1])


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer of LAYERS: add it where it belongs"
    return max(matches)[1]


def test_every_module_imports_only_its_own_layer_and_the_layers_below() -> None:
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})"
        for module, imported_set in imports().items()
        for imported in sorted(imported_set)
        if layer_of(imported) > layer_of(module)
    ]
    assert not upward, "imports across the layers, upward:\n" + "\n".join(upward)


def test_the_optional_features_import_no_other_one() -> None:
    for module, imported in imports().items():
        home = module.split(".")[0]
        if home in OPTIONAL:
            others = sorted(m for m in imported if m.split(".")[0] in OPTIONAL and m.split(".")[0] != home)
            assert not others, f"{module} imports {others}: each feature stands alone"


def test_the_optional_features_are_one_layer() -> None:
    assert set(dict(LAYERS)["the optional features"]) == set(OPTIONAL)


#: What one reader takes in at once: a module of at most this many lines, a class of at most that.
MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 300


def test_modules_and_classes_stay_small_enough_to_read_at_once() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{module_name(path)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, (
        f"split these (at most {MAX_MODULE_LINES} lines a module, {MAX_CLASS_LINES} a class): {too_long}"
    )
