"""What Python 3.9 lacks, in the files a series adds or changes: upstream's CI runs 3.9 to 3.12.

Syntax is checked by Python 3.9 itself where one is installed (``python3.9`` on PATH, or pyenv's),
else by ``ast.parse(feature_version=(3, 9))``. The constructs that parse under 3.9 but fail when
they run are found in the tree: ``dataclass(slots=True)`` and ``kw_only``, ``zip(strict=...)``,
typing names added in 3.10 and later, and ``X | Y`` of types evaluated at run time (in
``isinstance``/``issubclass``, or in annotations of a module without ``from __future__ import
annotations``).
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

__all__ = ["python39", "runtime_problems", "syntax_problems"]

#: Names ``typing`` gained after 3.9.
NEWER_TYPING = frozenset(
    {
        "Concatenate",
        "LiteralString",
        "Never",
        "ParamSpec",
        "ParamSpecArgs",
        "ParamSpecKwargs",
        "Self",
        "TypeAlias",
        "TypeGuard",
        "TypeVarTuple",
        "Unpack",
        "assert_never",
        "assert_type",
        "dataclass_transform",
        "override",
        "reveal_type",
    }
)
#: Keyword arguments that 3.10 and later added to functions the standard library had.
NEWER_KEYWORDS = {"dataclass": frozenset({"slots", "kw_only", "match_args"}), "zip": frozenset({"strict"})}


def python39() -> Optional[str]:
    """A Python 3.9 interpreter of this machine that runs (pyenv's, or ``python3.9`` on PATH), or ``None``."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(os.path.join(root, "versions", "3.9.*", "bin", "python3.9")))
    candidates += [found for found in [shutil.which("python3.9")] if found]
    for candidate in candidates:
        version = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
        )
        if version.stdout.strip() == "(3, 9)":
            return candidate
    return None


def syntax_problems(files: Sequence[Path]) -> List[str]:
    """``path: message`` for each file that Python 3.9 cannot parse."""
    interpreter = python39()
    if interpreter is None:
        problems = []
        for path in files:
            try:
                ast.parse(path.read_text(), str(path), feature_version=(3, 9))
            except SyntaxError as e:
                problems.append(f"{path}: {e.msg} (line {e.lineno})")
        return problems
    code = (
        "import ast, sys\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        ast.parse(open(path, encoding='utf-8').read(), path)\n"
        "    except SyntaxError as e:\n"
        "        print(f'{path}: {e.msg} (line {e.lineno})')\n"
    )
    done = subprocess.run(
        [interpreter, "-c", code, *map(str, files)], capture_output=True, text=True, timeout=300
    )
    return done.stdout.splitlines() + ([done.stderr.strip()] if done.returncode else [])


def runtime_problems(source: str, where: str = "<source>") -> List[str]:
    """``where:line: construct`` for each construct of ``source`` that fails under Python 3.9."""
    tree = ast.parse(source)
    postponed = any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )
    return [f"{where}:{line}: {what}" for line, what in _findings(tree, postponed)]


def _findings(tree: ast.Module, postponed: bool) -> Iterator[Tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "typing":
            for alias in node.names:
                if alias.name in NEWER_TYPING:
                    yield node.lineno, f"typing.{alias.name} is newer than Python 3.9"
        elif isinstance(node, ast.Call):
            name = _called(node.func)
            for keyword in node.keywords:
                if keyword.arg in NEWER_KEYWORDS.get(name or "", ()):
                    yield node.lineno, f"{name}({keyword.arg}=...) is newer than Python 3.9"
            if name in ("isinstance", "issubclass") and len(node.args) == 2 and _is_union(node.args[1]):
                yield node.lineno, f"{name}() with X | Y needs Python 3.10"
        elif not postponed and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            annotated = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            annotated += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            annotations = [a.annotation for a in annotated] + [node.returns]
            for annotation in annotations:
                if annotation is not None and _is_union(annotation):
                    yield annotation.lineno, "an annotation X | Y is evaluated at run time before Python 3.10"
        elif not postponed and isinstance(node, ast.AnnAssign) and _is_union(node.annotation):
            yield node.lineno, "an annotation X | Y is evaluated at run time before Python 3.10"


def _called(func: ast.expr) -> Optional[str]:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_union(node: ast.expr) -> bool:
    """Whether ``node`` holds ``X | Y`` of types (names, attributes, subscripts or ``None``)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.BitOr):
            operands = (inner.left, inner.right)
            if all(
                isinstance(o, (ast.Name, ast.Attribute, ast.Subscript, ast.BinOp, ast.Constant))
                for o in operands
            ):
                return True
    return False
