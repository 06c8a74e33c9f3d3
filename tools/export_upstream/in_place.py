"""The state added to torchdata's own classes in place.

In the package, a DataPipe class of torchdata whose state lives in its generator gets a
resumable subclass (``class ResumableHeader(HeaderIterDataPipe, Resumable)``) that the adapter
tables name. In torchdata's tree the class itself keeps its state: the subclass's members join
the class (a method of the same name, ``__iter__``, is replaced where it stands), the class
takes the subclass's mixins, its bases after the first, before its own (``class
HeaderIterDataPipe(Resumable, IterDataPipe[T_co])``),
and the module that defined the subclass loses it, its adapter-table entries and its ``__all__``
listing. Placements name these classes (``in_place`` in series.toml).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

from errors import ManifestError
from rewrite import _all_names, _drop_unused_imports, _is_docstring, _spelled, _start


@dataclass(frozen=True)
class InPlace:
    """Subclass ``name`` of our module becomes part of ``upstream_class`` in ``path``."""

    name: str
    path: str
    upstream_class: str

    @classmethod
    def parse(cls, name: str, spec: str) -> InPlace:
        path, _, upstream_class = spec.partition(":")
        if not path.endswith(".py") or not upstream_class.isidentifier():
            raise ManifestError(f"in_place {name} = {spec!r} is not 'path/to/file.py:UpstreamClass'")
        return cls(name, path, upstream_class)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if len(found) != 1:
        raise ManifestError(f"the module defines no class {name} to put in place")
    return found[0]


def _names_in(node: ast.AST) -> Set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def fragment(source: str, spec: InPlace) -> str:
    """A fragment (see splice.py) that adds subclass ``spec.name`` of ``source`` to its upstream
    class: its members, its bases but the first (the upstream class), the imports they use."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    node = _class(tree, spec.name)
    if not node.bases:
        raise ManifestError(f"{spec.name} extends no class of torchdata's")
    used = _names_in(node) - _names_in(node.bases[0])
    imports: List[str] = []
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module != "__future__":
            names = [a for a in statement.names if (a.asname or a.name) in used]
            if names:
                imports.append(f"from {statement.module} import {', '.join(map(_spelled, names))}\n")
        elif isinstance(statement, ast.Import):
            imports += [f"import {_spelled(a)}\n" for a in statement.names if (a.asname or a.name) in used]
    members = [m for m in node.body if not _is_docstring(m)]
    body = "".join(lines[_start(members[0]) : node.end_lineno])
    bases = ", ".join(ast.unparse(base) for base in node.bases[1:])
    return (
        f"TARGET = {spec.path!r}\n\n"
        + "".join(imports)
        + f"\n\nclass {spec.upstream_class}({bases}):\n"
        + body
    )


def without(source: str, names: Sequence[str]) -> str:
    """``source`` without the classes ``names``, the entries of its module-level dicts whose value
    is one of them (one entry a line), their ``__all__`` listing and the imports only they used."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    cut: List[Tuple[int, int]] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            end = node.end_lineno or node.lineno
            while end < len(lines) and not lines[end].strip():
                end += 1
            cut.append((_start(node), end))
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Dict):
            for key, entry in zip(value.keys, value.values):
                if isinstance(entry, ast.Name) and entry.id in names and key is not None:
                    if lines[key.lineno - 1].strip().count(":") != 1:
                        raise ManifestError(f"the entry for {entry.id} does not have a line of its own")
                    cut.append((key.lineno - 1, entry.end_lineno or entry.lineno))
    listed = _all_names(tree) or []
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            for element in node.value.elts:  # type: ignore[attr-defined]
                if element.value in names:
                    if lines[element.lineno - 1].strip() != f'"{element.value}",':
                        raise ManifestError(f"{element.value} is not listed on a line of its own in __all__")
                    cut.append((element.lineno - 1, element.end_lineno))
    for start, end in sorted(cut, reverse=True):
        del lines[start:end]
    text = "".join(lines)
    return _drop_unused_imports(text, keep=[n for n in listed if n not in names])


def in_place_specs(entries: Dict[str, str]) -> Tuple[InPlace, ...]:
    return tuple(InPlace.parse(name, spec) for name, spec in entries.items())
