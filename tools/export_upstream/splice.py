"""Put a fragment of our code at named places of an upstream file, without carrying its lines.

A fragment (``rfc/*.py``, or one in_place.py makes) is a Python module naming the file it joins
(``TARGET``). Its classes that upstream's file defines too add their members to upstream's class
(attributes first, methods last; a method upstream's class defines is replaced where it stands)
and their bases before upstream's; its other definitions follow upstream's code under a comment
that carries the fragment's docstring; its imports join upstream's where upstream's file lacks the names.
``BRANCHES`` adds a branch to one of upstream's request loops, before its final ``else``, testing
the request type as the loop's other branches do; ``AT_END`` adds a statement at the end of one
of upstream's methods (before its ``return``). A place that is not where expected is refused.
"""

from __future__ import annotations

import ast
from typing import Dict, List, Optional, Sequence, Set, Tuple

from errors import UpstreamLayoutError
from rewrite import _as_comment, _bound_names, _insert_imports, _is_docstring, _spelled, _start

#: The fragment's own settings, which do not go into upstream's file.
SETTINGS = ("TARGET", "BRANCHES", "AT_END")

Insertion = Tuple[int, str]  # (0-based line before which the text goes, the text)
Replacement = Tuple[int, int, str]  # (0-based first line, line after the last, the new text)


def target_of(fragment: str) -> str:
    """The upstream file the fragment joins (its ``TARGET``)."""
    return str(_settings(ast.parse(fragment)).get("TARGET", ""))


def _settings(tree: ast.Module) -> Dict[str, object]:
    found: Dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and set(_bound_names(node)) & set(SETTINGS):
            value = node.value
            assert value is not None
            found[_bound_names(node)[0]] = ast.literal_eval(value)
    return found


def _text(lines: Sequence[str], node: ast.AST) -> str:
    return "".join(lines[_start(node) : node.end_lineno])  # type: ignore[arg-type,attr-defined]


def _classes(tree: ast.Module) -> Dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _function(tree: ast.Module, qualified: str) -> ast.FunctionDef:
    """The function (``name``) or method (``Class.name``) of ``tree``."""
    scope: Sequence[ast.stmt] = tree.body
    *owners, name = qualified.split(".")
    for owner in owners:
        scope = next((n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == owner), [])
    found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        raise UpstreamLayoutError(f"{qualified} is not defined once where the series expects it")
    return found[0]


def _request_chain(function: ast.FunctionDef) -> ast.If:
    """The outermost ``if isinstance(request, ...)`` of a request loop."""
    for node in ast.walk(function):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Call)
            and getattr(node.test.func, "id", None) == "isinstance"
            and getattr(node.test.args[0], "id", None) == "request"
        ):
            return node
    raise UpstreamLayoutError(f"{function.name} has no `if isinstance(request, ...)` to add a branch to")


def _branch(lines: List[str], tree: ast.Module, function: str, request: str, statement: str) -> Insertion:
    chain = _request_chain(_function(tree, function))
    spelled = ast.unparse(chain.test.args[1])  # type: ignore[attr-defined]
    prefix = spelled.rsplit(".", 1)[0] + "." if "." in spelled else ""
    indent = lines[chain.lineno - 1][: chain.col_offset]
    last = chain
    while len(last.orelse) == 1 and isinstance(last.orelse[0], ast.If):
        last = last.orelse[0]
    text = f"\n{indent}elif isinstance(request, {prefix}{request}):\n{indent}    {statement}\n"
    if not last.orelse:
        return (last.end_lineno or last.lineno, text)
    at = last.orelse[0].lineno - 2  # the `else:` line, 0-based
    while at > 0 and lines[at].strip() != "else:":
        at -= 1
    if lines[at].strip() != "else:":
        raise UpstreamLayoutError(f"the request loop of {function} has no `else:` where expected")
    return (at, text)


def _at_end(lines: List[str], tree: ast.Module, method: str, statement: str) -> Insertion:
    function = _function(tree, method)
    last = function.body[-1]
    indent = lines[last.lineno - 1][: last.col_offset]
    if isinstance(last, ast.Return):
        return (last.lineno - 1, f"{indent}{statement}\n")
    return (last.end_lineno or last.lineno, f"{indent}{statement}\n")


def _imports(fragment: ast.Module, upstream_bound: Set[str]) -> List[str]:
    """The fragment's imports of names upstream's file does not bind."""
    statements = []
    for node in fragment.body:
        if isinstance(node, ast.ImportFrom):
            names = [a for a in node.names if (a.asname or a.name) not in upstream_bound]
            if names:
                statements.append(f"from {node.module} import {', '.join(map(_spelled, names))}")
        elif isinstance(node, ast.Import):
            statements += [
                f"import {_spelled(a)}"
                for a in node.names
                if (a.asname or a.name.split(".")[0]) not in upstream_bound
            ]
    return statements


def splice(upstream: str, fragment: str) -> str:
    """``fragment`` put into ``upstream`` (the text of its ``TARGET``)."""
    tree, ours = ast.parse(upstream), ast.parse(fragment)
    lines, our_lines = upstream.splitlines(keepends=True), fragment.splitlines(keepends=True)
    settings = _settings(ours)
    upstream_classes = _classes(tree)
    insertions: List[Insertion] = []
    replacements: List[Replacement] = []
    appended: List[str] = []
    for node in ours.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _is_docstring(node):
            continue
        if set(_bound_names(node)) & set(SETTINGS):
            continue
        if isinstance(node, ast.ClassDef) and node.name in upstream_classes:
            upstream_class = upstream_classes[node.name]
            insertions += _members(lines, our_lines, upstream_class, node)
            replacements += _replaced_methods(lines, our_lines, upstream_class, node)
            if node.bases:
                replacements.append(_with_bases(lines, upstream_class, node))
        else:
            appended.append(_text(our_lines, node).rstrip("\n"))
    for function, request, statement in settings.get("BRANCHES", ()):  # type: ignore[attr-defined]
        insertions.append(_branch(lines, tree, function, request, statement))
    for method, statement in settings.get("AT_END", ()):  # type: ignore[attr-defined]
        insertions.append(_at_end(lines, tree, method, statement))
    edits = replacements + [(at, at, text) for at, text in insertions]
    for start, end, text in sorted(edits, key=lambda item: (item[0], item[1]), reverse=True):
        lines[start:end] = [text]
    text = "".join(lines).rstrip("\n") + "\n"
    if appended:
        docstring = ast.get_docstring(ours, clean=True)
        header = _as_comment(docstring) + "\n" if docstring else ""
        text += "\n\n" + header + "\n\n\n".join(appended) + "\n"
    bound = {name for node in tree.body for name in _bound_names(node)}
    imports = _imports(ours, bound)
    if imports:
        text = _insert_imports(text, "\n".join(imports))
    return _extend_all(text, [n for block in appended for n in _public_names(block)])


def _method_names(cls: ast.ClassDef) -> Set[str]:
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _replaced_methods(
    lines: List[str], our_lines: List[str], upstream: ast.ClassDef, ours: ast.ClassDef
) -> List[Replacement]:
    """Our methods that upstream's class defines too, in place of upstream's: upstream's
    signature (its annotations, in the terms of its file) and our body; our signature where
    ours adds parameters (with defaults, so that upstream's callers stay valid)."""
    theirs = {n.name: n for n in upstream.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: List[Replacement] = []
    for node in ours.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in theirs:
            their = theirs[node.name]
            if _parameters(node) == _parameters(their):
                signature = "".join(lines[_start(their) : their.body[0].lineno - 1])
            else:
                signature = "".join(our_lines[_start(node) : node.body[0].lineno - 1])
            body = "".join(our_lines[node.body[0].lineno - 1 : node.end_lineno])
            found.append((_start(their), their.end_lineno or their.lineno, signature + body))
    return found


def _parameters(node: ast.AST) -> List[str]:
    arguments = node.args  # type: ignore[attr-defined]
    return [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


def _with_bases(lines: List[str], upstream: ast.ClassDef, ours: ast.ClassDef) -> Replacement:
    """Upstream's class line with our class's bases first (mixins, before upstream's bases)."""
    at = upstream.lineno - 1
    line = lines[at]
    opening = line.find(f"class {upstream.name}(")
    if opening < 0 or upstream.end_lineno == upstream.lineno:
        raise UpstreamLayoutError(f"class {upstream.name} is not declared as `class {upstream.name}(...):`")
    bases = ", ".join(ast.unparse(base) for base in ours.bases)
    cut = opening + len(f"class {upstream.name}(")
    return (at, at + 1, f"{line[:cut]}{bases}, {line[cut:]}")


def _members(
    lines: List[str], our_lines: List[str], upstream: ast.ClassDef, ours: ast.ClassDef
) -> List[Insertion]:
    """Our class's members into upstream's class: attributes after its docstring, methods last
    (but those upstream's class defines, which replace upstream's where they stand)."""
    attributes = [n for n in ours.body if isinstance(n, (ast.Assign, ast.AnnAssign))]
    replaced = _method_names(upstream)
    methods = [
        n
        for n in ours.body
        if not isinstance(n, (ast.Assign, ast.AnnAssign))
        and not _is_docstring(n)
        and getattr(n, "name", None) not in replaced
    ]
    found: List[Insertion] = []
    if attributes:
        first = upstream.body[0]
        at = (first.end_lineno or first.lineno) if _is_docstring(first) else _start(first)
        found.append((at, "".join(_text(our_lines, n) for n in attributes)))
    if methods:
        at = upstream.end_lineno or upstream.lineno
        found.append((at, "".join("\n" + _text(our_lines, n) for n in methods)))
    return found


def _public_names(block: str) -> List[str]:
    return [n for node in ast.parse(block).body for n in _bound_names(node) if not n.startswith("_")]


def _extend_all(text: str, names: Sequence[str]) -> str:
    """``__all__`` of ``text``, if it has one, also lists ``names`` (sorted if it was)."""
    tree = ast.parse(text)
    listing: Optional[ast.Assign] = next(
        (n for n in tree.body if isinstance(n, ast.Assign) and _bound_names(n) == ["__all__"]), None
    )
    if listing is None or not names:
        return text
    old = list(ast.literal_eval(listing.value))
    new = old + [n for n in names if n not in old]
    if old == sorted(old):
        new = sorted(new)
    lines = text.splitlines(keepends=True)
    spelled = "__all__ = [\n" + "".join(f'    "{n}",\n' for n in new) + "]\n"
    lines[_start(listing) : listing.end_lineno] = [spelled]
    return "".join(lines)
