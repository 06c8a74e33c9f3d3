"""Source transformations: the package's references made torchdata's, a module merged into the
upstream file it changes, a test file cut into the slices that go with successive commits."""

from __future__ import annotations

import ast
import re
from typing import Dict, List, Optional, Sequence, Set, Tuple

from errors import ManifestError, UpstreamLayoutError
from manifest import PACKAGE, Manifest, Placement, public_name_modules

#: Where the package's public names are importable once the series is applied.
PUBLIC_HOME = "torchdata.dataloader2"


def _import_statement(module: str, names: Sequence[str], indent: str = "") -> str:
    """``from module import names``, parenthesized one name a line when it would be long."""
    line = f"{indent}from {module} import {', '.join(names)}"
    if len(line) <= 120:
        return line
    listed = "".join(f"{indent}    {name},\n" for name in names)
    return f"{indent}from {module} import (\n{listed}{indent})"


def rewrite(source: str, manifest: Manifest) -> str:
    """``source`` with every reference to the package's modules and names made torchdata's."""
    public = public_name_modules()
    lines = source.splitlines(keepends=True)
    edits: List[Tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and [a.name for a in node.names] == [PACKAGE]:
            indent = _indent(lines[node.lineno - 1])
            asname = node.names[0].asname
            statement = f"{indent}import {PUBLIC_HOME}" + (f" as {asname}" if asname else "")
            edits.append((node.lineno - 1, node.end_lineno or node.lineno, statement + "\n"))
            continue
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE):
            continue
        by_module: Dict[str, List[str]] = {}
        for alias in node.names:
            inside = node.module[len(PACKAGE) + 1 :]
            if inside in manifest.placements:  # from torchdata_snapshot.core.messages import name
                home = manifest.placement(inside).dotted
                by_module.setdefault(home, []).append(_spelled(alias))
            elif (f"{inside}.{alias.name}" if inside else alias.name) in manifest.placements:
                # from torchdata_snapshot.core import messages as m; from torchdata_snapshot import _x
                module = f"{inside}.{alias.name}" if inside else alias.name
                parent, leaf = manifest.placement(module).dotted.rsplit(".", 1)
                by_module.setdefault(parent, []).append(f"{leaf} as {alias.asname or alias.name}")
            elif inside:
                raise ManifestError(f"{node.module} is neither a module of the package nor a folder of them")
            else:  # from torchdata_snapshot import PublicName
                home = manifest.placement(public[alias.name]).dotted
                by_module.setdefault(home, []).append(_spelled(alias))
        indent = _indent(lines[node.lineno - 1])
        statements = "".join(
            _import_statement(module, names, indent) + "\n" for module, names in sorted(by_module.items())
        )
        edits.append((node.lineno - 1, node.end_lineno or node.lineno, statements))
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start:end] = [replacement]
    text = "".join(lines)
    text = re.sub(
        rf"\b{PACKAGE}\.([a-z_][a-z_0-9]*(?:\.[a-z_][a-z_0-9]*)*)", lambda m: _homed(m, manifest), text
    )
    for name, module in public.items():  # "call torchdata_snapshot.register_state_functions()"
        # Public names live in torchdata.dataloader2 at the end of the series; those it does
        # not re-export stay in their module, but for the reading service, which it had already.
        exported = name not in manifest.not_reexported or name == "MultiProcessingReadingService"
        home = PUBLIC_HOME if exported else manifest.placement(module).dotted
        text = re.sub(rf"\b{PACKAGE}\.{name}\b", f"{home}.{name}", text)
    # What is left names the package as a whole (``torchdata_snapshot.__file__``, a module name
    # given to forkserver's preload): its home is torchdata.dataloader2.
    text = re.sub(rf"\b{PACKAGE}\b", PUBLIC_HOME, text)
    for pattern, replacement in manifest.text_rules:  # the repository's docs and scripts
        text = re.sub(pattern, replacement, text)
    return text


def _homed(match: re.Match[str], manifest: Manifest) -> str:
    """``torchdata_snapshot.core.outlet.Outlet`` -> ``torchdata.dataloader2.communication.outlet.Outlet``:
    the longest dotted prefix that is a module of the package takes its place in torchdata."""
    parts = match.group(1).split(".")
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        if module in manifest.placements:
            return ".".join([manifest.placement(module).dotted, *parts[n:]])
    return match.group(0)


def rewrite_test(source: str, manifest: Manifest) -> str:
    """A test of the repository as it runs in torchdata's tree."""
    text = rewrite(source, manifest)
    text = text.replace("TORCHDATA_SNAPSHOT_", "DATALOADER2_TEST_")
    for option, default in (("--mp-context", "None"), ("--fuzz-examples", "40"), ("--full-matrix", "False")):
        text = text.replace(f'getoption("{option}")', f'getoption("{option}", {default})')
    for old, new in manifest.test_renames.items():
        text = re.sub(rf"\b{old[:-3]}\b", new[:-3], text)
    return text


def _spelled(alias: ast.alias) -> str:
    return alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _bound_names(node: ast.stmt) -> List[str]:
    """The module-level names a top-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _all_names(tree: ast.Module) -> Optional[List[str]]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            return [elt.value for elt in node.value.elts]  # type: ignore[attr-defined]
    return None


def _start(node: ast.stmt) -> int:
    """0-based first line of a statement, decorators included."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators]) - 1


def _as_comment(docstring: str) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in docstring.strip("\n").splitlines())


def merge(upstream: str, ours: str, placement: Placement) -> str:
    """``ours`` (already rewritten) merged into the upstream file ``upstream``: upstream's
    definitions of the names ours defines are deleted, ours follow upstream's code under a comment
    that carries our module docstring, imports join upstream's, names imported from the file
    itself are used directly, upstream imports nothing uses any more are dropped, and ``__all__``
    lists both."""
    target = placement.dotted
    up_tree, our_tree = ast.parse(upstream), ast.parse(ours)
    our_lines = ours.splitlines(keepends=True)

    skip: Set[int] = set()  # 0-based lines of ours that do not go into the body
    docstring = ""
    imports: List[Tuple[str, List[str]]] = []  # (module, ["name", "name as alias"])
    plain_imports: List[str] = []
    self_aliases: Set[str] = set()
    up_bound: Set[str] = {n for node in up_tree.body for n in _bound_names(node)}
    ours_defined = {
        n
        for node in our_tree.body
        if not isinstance(node, (ast.Import, ast.ImportFrom))
        for n in _bound_names(node)
    } - {"__all__"}
    parent, leaf = target.rsplit(".", 1)
    for index, node in enumerate(our_tree.body):
        span = range(_start(node), node.end_lineno or node.lineno)
        if index == 0 and _is_docstring(node):
            docstring = ast.get_docstring(our_tree, clean=True) or ""
            skip.update(span)
        elif isinstance(node, ast.ImportFrom):
            skip.update(span)
            if node.module == "__future__":
                # Not carried over: with ``annotations`` in upstream's file, pyupgrade would
                # rewrite every annotation of upstream's own code. Ours evaluate at definition.
                continue
            kept = []
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == target:
                    continue  # a name of the file itself
                if node.module == parent and alias.name == leaf:
                    self_aliases.add(bound)
                    continue
                if bound in up_bound and bound not in ours_defined:
                    continue  # upstream's file imports it already
                kept.append(_spelled(alias))
            if kept:
                imports.append((node.module or "", kept))
        elif isinstance(node, ast.Import):
            skip.update(span)
            for alias in node.names:
                if (alias.asname or alias.name) not in up_bound:
                    plain_imports.append(f"import {_spelled(alias)}")
        elif isinstance(node, ast.Assign) and _bound_names(node) == ["__all__"]:
            skip.update(span)
    body = "".join(line for i, line in enumerate(our_lines) if i not in skip)
    for own in self_aliases:
        body = re.sub(rf"\b{own}\.(\w+)", r"\1", body)
    for name in ours_defined:  # class X(X, Base): upstream's X was the base; ours replaces it
        body = re.sub(rf"(class {name}\()\s*{name},\s*", r"\1", body)
    body = re.sub(r"\n{3,}", "\n\n\n", body).strip("\n")

    # Upstream's definitions of the names ours defines go.
    lines = upstream.splitlines(keepends=True)
    replaced = [
        node
        for node in up_tree.body
        if set(_bound_names(node)) & ours_defined and not isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    for node in sorted(replaced, key=lambda n: n.lineno, reverse=True):
        del lines[_start(node) : node.end_lineno]
    upstream_kept = "".join(lines)

    import_block = "\n".join(sorted(plain_imports) + [_import_statement(m, n) for m, n in sorted(imports)])
    section = f"\n\n{_as_comment(docstring)}" if docstring else "\n\n"
    text = upstream_kept.rstrip("\n") + "\n" + section + "\n" + body + "\n"
    if import_block:
        text = _insert_imports(text, import_block)
    text = _drop_unused_imports(text, keep=_all_names(ast.parse(upstream)) or [])
    our_all = _all_names(our_tree)
    up_all = _all_names(ast.parse(text))
    if our_all and up_all is None:
        # Ours lists its public names; the file then lists upstream's public definitions (all of
        # them were its public names) and ours, not the helpers ours keeps to itself.
        defined = sorted(
            {
                n
                for node in up_tree.body
                if not isinstance(node, (ast.Import, ast.ImportFrom))
                for n in _bound_names(node)
            }
            | set(our_all)
        )
        listing = "__all__ = [\n" + "".join(f'    "{n}",\n' for n in defined if not n.startswith("_")) + "]\n"
        text = _insert_after_imports(text, listing)
    elif our_all and up_all is not None:
        names = (
            sorted(set(up_all) | set(our_all))
            if up_all == sorted(up_all)
            else up_all + [n for n in our_all if n not in up_all]
        )
        text = re.sub(
            r"__all__ = \[.*?\]",
            lambda _: "__all__ = [\n" + "".join(f'    "{n}",\n' for n in names) + "]",
            text,
            count=1,
            flags=re.S,
        )
    return re.sub(r"\n{4,}", "\n\n\n", text)


def _first_statement_line(tree: ast.Module) -> int:
    body = tree.body[1:] if tree.body and _is_docstring(tree.body[0]) else tree.body
    return _start(body[0]) if body else 0


def _insert_imports(text: str, block: str) -> str:
    """``block`` after the last import of the file's leading imports."""
    tree = ast.parse(text)
    last = None
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node
        elif not _is_docstring(node):
            break
    lines = text.splitlines(keepends=True)
    if last is None:  # (error.py has none): the imports go before the first statement
        at = _first_statement_line(tree)
        lines[at:at] = [block + "\n", "\n\n"]
        return "".join(lines)
    at = last.end_lineno or last.lineno
    lines[at:at] = ["\n", block + "\n"]
    return "".join(lines)


def _insert_after_imports(text: str, block: str) -> str:
    """``block`` after the file's leading imports (after the late ones' comment, if any)."""
    tree = ast.parse(text)
    at = _first_statement_line(tree)
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            at = node.end_lineno or node.lineno
        elif not _is_docstring(node):
            break
    lines = text.splitlines(keepends=True)
    lines[at:at] = ["\n\n", block]
    return "".join(lines)


def _used_names(tree: ast.AST) -> Set[str]:
    used: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)  # string annotations, __all__
    return used


def drop_unused_typing_imports(text: str) -> str:
    """``from typing import`` names nothing uses (pyupgrade rewrote ``List[int]`` as
    ``list[int]``) dropped, as flake8 would ask."""
    return _drop_unused_imports(text, keep=_all_names(ast.parse(text)) or [], only=("typing",))


def _drop_unused_imports(text: str, keep: Sequence[str], only: Optional[Tuple[str, ...]] = None) -> str:
    """Top-level imports of names nothing in the file uses any more (upstream's old class used
    them) are dropped, alias by alias; with ``only``, imports from those modules only."""
    tree = ast.parse(text)
    used = _used_names(tree) | set(keep)
    # Annotations under ``from __future__ import annotations`` are strings only at run time: the
    # tree still has them as expressions, so _used_names sees them.
    lines = text.splitlines(keepends=True)
    edits: List[Tuple[int, int, str]] = []
    for node in tree.body:
        if only is not None and not (isinstance(node, ast.ImportFrom) and node.module in only):
            continue
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            kept = [a for a in node.names if (a.asname or a.name) in used]
            if len(kept) == len(node.names):
                continue
            new = _import_statement(node.module or "", [_spelled(a) for a in kept]) + "\n" if kept else ""
            edits.append((node.lineno - 1, node.end_lineno or node.lineno, new))
        elif isinstance(node, ast.Import):
            kept = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
            if len(kept) == len(node.names):
                continue
            new = "".join(f"import {_spelled(a)}\n" for a in kept)
            edits.append((node.lineno - 1, node.end_lineno or node.lineno, new))
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start:end] = [replacement]
    return "".join(lines)


def without_tests(source: str, names: Sequence[str]) -> str:
    """``source`` without the tests ``names``, top-level or methods of a test class (their
    decorators, the comment block right above them and the blank lines after them): the tests an
    optional feature's commit adds, or those a later commit adds with the tables they need. What
    only those tests used goes with them (:func:`_unused_helpers_dropped`)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    members = [m for node in tree.body if isinstance(node, ast.ClassDef) for m in node.body]
    for node in sorted(tree.body + members, key=lambda n: n.lineno, reverse=True):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            start, end = _start(node), node.end_lineno or node.lineno
            while start > 0 and lines[start - 1].lstrip().startswith("#"):
                start -= 1
            while end < len(lines) and not lines[end].strip():
                end += 1
            del lines[start:end]
    return _unused_helpers_dropped(source, "".join(lines).rstrip("\n") + "\n")


def _filled_table(node: ast.stmt) -> Optional[str]:
    """The module-level name whose entries ``node`` sets (``TABLE[key] = ...``), if that is all
    it does."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AugAssign):
        targets = [node.target]
    else:
        return None
    roots = set()
    for target in targets:
        if not isinstance(target, (ast.Subscript, ast.Attribute)):
            return None
        while isinstance(target, (ast.Subscript, ast.Attribute)):
            target = target.value
        if not isinstance(target, ast.Name):
            return None
        roots.add(target.id)
    return roots.pop() if len(roots) == 1 else None


def _helper_names(node: ast.stmt) -> Set[str]:
    """The module-level names a top-level statement of a test file defines or fills, where dropping
    it once nothing else uses them is safe: an undecorated helper function or class (not a test),
    a table, entries set in a table (under an ``if`` too); none for any other statement."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        test = node.name.lower().startswith("test")
        return set() if test or node.decorator_list else {node.name}
    if (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets)) or (
        isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
    ):
        bound = set(_bound_names(node))
        return set() if any(n.startswith("__") for n in bound) else bound
    table = _filled_table(node)
    if table is not None:
        return {table}
    if isinstance(node, ast.If) and "__name__" not in ast.dump(node.test):
        parts = [_helper_names(n) for n in node.body + node.orelse]
        return set().union(*parts) if all(parts) else set()
    return set()


def _unused_helpers_dropped(before: str, after: str) -> str:
    """``after`` (``before`` without some of its tests) without the module-level helpers and
    tables (:func:`_helper_names`) that nothing left uses, the comment block right above each, and
    the imports only they used (never one ``before`` did not use either: it may be there for its
    side effects)."""
    while True:
        tree = ast.parse(after)
        owned = [_helper_names(node) for node in tree.body]
        dropped = []
        for node, names in zip(tree.body, owned):
            users = [other for other, theirs in zip(tree.body, owned) if not theirs & names]
            if names and not any(names & _used_names(other) for other in users):
                dropped.append(node)
        if not dropped:
            break
        lines = after.splitlines(keepends=True)
        for node in sorted(dropped, key=lambda n: n.lineno, reverse=True):
            start, end = _start(node), node.end_lineno or node.lineno
            while start > 0 and lines[start - 1].startswith("#"):
                start -= 1
            while end < len(lines) and not lines[end].strip():
                end += 1
            del lines[start:end]
        after = "".join(lines).rstrip("\n") + "\n"
    return _newly_unused_imports_dropped(before, after)


def _newly_unused_imports_dropped(before: str, after: str) -> str:
    """``after`` without the top-level imports of names that ``before`` used and ``after`` does
    not any more."""
    gone = _used_names(ast.parse(before)) - _used_names(ast.parse(after))
    imported = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.parse(after).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    return _drop_unused_imports(after, keep=sorted(imported - gone))


def without_definitions(source: str, names: Sequence[str]) -> str:
    """``source`` (an upstream file) without its top-level definitions of ``names``: what the
    series' code replaced, deleted once nothing uses it. The comment block right above each goes
    with it, and a section comment whose definitions all went; ``__all__`` no longer lists them,
    and the imports only they used go."""
    tree = ast.parse(source)
    found = [
        node
        for node in tree.body
        if not isinstance(node, (ast.Import, ast.ImportFrom)) and set(_bound_names(node)) & set(names)
    ]
    missing = set(names) - {n for node in found for n in _bound_names(node)}
    if missing:
        raise UpstreamLayoutError(f"no top-level definition of {sorted(missing)} to delete")
    lines = source.splitlines(keepends=True)
    for node in sorted(found, key=lambda n: n.lineno, reverse=True):
        start, end = _start(node), node.end_lineno or node.lineno
        while start > 0 and lines[start - 1].startswith("#"):
            start -= 1
        del lines[start:end]
        _drop_orphaned_section_comment(lines, start)
    text = "".join(lines)
    listed = _all_names(ast.parse(text))
    if listed and set(listed) & set(names):
        kept = "".join(f'    "{n}",\n' for n in listed if n not in names)
        text = re.sub(r"__all__ = \[.*?\]", lambda _: f"__all__ = [\n{kept}]", text, count=1, flags=re.S)
    text = re.sub(r"\n{4,}", "\n\n\n", text).rstrip("\n") + "\n"
    still_used = set(names) & _used_names(ast.parse(text))
    if still_used:
        raise UpstreamLayoutError(f"{sorted(still_used)} cannot be deleted: the rest of the file uses them")
    return _newly_unused_imports_dropped(source, text)


def _drop_orphaned_section_comment(lines: List[str], at: int) -> None:
    """Where a definition was deleted (``lines[at]``): the comment that headed its section, apart
    by blank lines, goes when nothing follows it but blank lines before the next section's
    comment or the end of the file."""
    below = at
    while below < len(lines) and not lines[below].strip():
        below += 1
    if below < len(lines) and not lines[below].startswith("#"):
        return
    following = below
    while following < len(lines) and lines[following].startswith("#"):
        following += 1
    if following < len(lines) and lines[following].strip():
        return  # the comment right above the next definition: the section goes on
    end = at
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    start = end
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    if 0 < start < end and not lines[start - 1].strip():
        del lines[start:at]


def test_slices(source: str, parts: int) -> List[str]:
    """``source`` cut into ``parts`` cumulative texts: the first holds the file's header (imports,
    helpers) and the first slice of its tests, each next one the tests up to its slice. A file
    whose tests are the methods of one test class is cut between its methods, the class's
    header and what follows the class (``instantiate_parametrized_tests``) in every slice."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")]
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    if len(classes) == 1 and not functions:
        return _method_slices(classes[0], lines, parts)
    first_test = next(
        (
            _start(node)
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.lower().startswith("test")
        ),
        len(lines),
    )
    starts = [_start(node) for node in tree.body if _start(node) >= first_test]
    if parts == 1 or len(starts) < parts:
        return [source] * parts
    total = len(lines) - first_test
    cuts = [first_test]
    for k in range(1, parts):
        goal = first_test + total * k // parts
        cut = min((s for s in starts if s > cuts[-1]), key=lambda s: abs(s - goal))
        cuts.append(cut)
    cuts.append(len(lines))
    # A comment block right above a statement goes with it.
    for i in range(1, len(cuts) - 1):
        while cuts[i] > cuts[i - 1] + 1 and lines[cuts[i] - 1].lstrip().startswith(("#", "@")):
            cuts[i] -= 1
    return ["".join(lines[: cuts[k + 1]]).rstrip("\n") + "\n" for k in range(parts)]


def _method_slices(cls: ast.ClassDef, lines: List[str], parts: int) -> List[str]:
    """The slices of a file whose tests are the methods of ``cls``: cut between its test methods."""
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    if parts == 1 or len(methods) < parts:
        return ["".join(lines)] * parts
    starts = [_start(m) for m in methods]
    for i, start in enumerate(starts):  # a comment block right above a method goes with it
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        starts[i] = start
    first, end = starts[0], cls.end_lineno or cls.lineno
    total = end - first
    cuts = [first]
    for k in range(1, parts):
        goal = first + total * k // parts
        cuts.append(min((s for s in starts if s > cuts[-1]), key=lambda s: abs(s - goal)))
    cuts.append(end)
    footer = "".join(lines[end:])
    return ["".join(lines[: cuts[k + 1]]).rstrip("\n") + "\n" + footer for k in range(parts)]
