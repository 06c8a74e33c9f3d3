"""What a map or filter function computes with, as a digest a checkpoint records: a function
changed between the run that saved a state and the one that restores it (a lambda's body, the
value a closure captures) is then refused by name, not replayed into a divergence.

Every lambda is called ``<lambda>``, so the name says nothing; the digest covers the function's
code (its bytecode, constants and the names it uses, nested functions included), its defaults,
and the values it reads: those its closure captured and the module globals it names, where they
are plain data. Other values (a tokenizer, a model) count by their type only: the checkpoint
cannot compare them. Bytecode differs between Python versions, so the digest carries the
version it was taken with, and digests of two versions are not compared.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import types
from typing import Any, Callable, List, Optional, Set

from torchdata_snapshot.core.graph import NOT_PLAIN, plain_data

__all__ = ["DIGEST_VERSION", "function_digest", "same_computation"]

#: The Python version a digest was taken with (bytecode is that version's), as its prefix.
DIGEST_VERSION = f"py{sys.version_info[0]}.{sys.version_info[1]}"

#: Packages whose functions only their name describes: they change with an upgrade of the library,
#: not with the pipeline (``collate()``'s ``default_collate``).
_LIBRARIES = frozenset({"torch", "torchdata", "numpy"})

#: How long a plain value may be (as JSON) to count by its value rather than by its type.
_VALUE_MAX_CHARS = 4096


def function_digest(fn: Callable[..., Any]) -> Optional[str]:
    """``"py3.11:<16 hex digits>"`` for a Python function or a ``functools.partial`` of one (its
    arguments are recorded beside it); ``None`` for other callables (a class, a builtin, a
    callable object) and for torch's, torchdata's and numpy's functions, which only their name
    describes."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not isinstance(fn, types.FunctionType) or fn.__module__.split(".")[0] in _LIBRARIES:
        return None
    return f"{DIGEST_VERSION}:{_function_hash(fn, set())}"


def same_computation(recorded: Any, current: Any) -> bool:
    """Whether two digests say the same (digests of other Python versions cannot say: they count
    as the same)."""
    if not (isinstance(recorded, str) and isinstance(current, str)):
        return True
    if recorded.split(":", 1)[0] != current.split(":", 1)[0]:
        return True
    return recorded == current


def _function_hash(fn: types.FunctionType, seen: Set[int]) -> str:
    """16 hex digits of what ``fn`` computes with (``seen``: the functions described on the way)."""
    parts: List[str] = []
    _describe_function(fn, parts, seen)
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def _describe_function(fn: types.FunctionType, parts: List[str], seen: Set[int]) -> None:
    if id(fn) in seen:  # a function that refers to itself
        parts.append("recursive")
        return
    seen.add(id(fn))
    _describe_code(fn.__code__, parts)
    parts.append("defaults " + _value(fn.__defaults__, seen))
    parts.append("kwdefaults " + _value(fn.__kwdefaults__, seen))
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            content = cell.cell_contents
        except ValueError:  # a cell not filled yet
            content = None
        parts.append(f"captured {name} " + _value(content, seen))
    for name in sorted(_global_names(fn.__code__)):
        if name in fn.__globals__:
            parts.append(f"global {name} " + _value(fn.__globals__[name], seen, functions=False))


def _describe_code(code: types.CodeType, parts: List[str]) -> None:
    parts.append(code.co_code.hex())
    parts.append(" ".join(code.co_names))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _describe_code(const, parts)
        else:
            parts.append(_constant(const))


def _constant(const: Any) -> str:
    """A code object's constant, the same in every process: ``x in {"a", "b"}`` compiles to a
    frozenset, whose order (and ``repr``) follows string hashing, which is salted per process."""
    if isinstance(const, frozenset):
        return "frozenset(" + ",".join(sorted(_constant(item) for item in const)) + ")"
    if isinstance(const, tuple):
        return "(" + ",".join(_constant(item) for item in const) + ")"
    return repr(const)


def _global_names(code: types.CodeType) -> Set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _value(value: Any, seen: Set[int], functions: bool = True) -> str:
    """A value a function reads: plain data as JSON, a function by what it computes (captured
    ones; a global function counts by name, as a module's own functions do), anything else by
    its type."""
    if functions and isinstance(value, types.FunctionType):
        return "function " + _function_hash(value, seen)
    if isinstance(value, functools.partial):
        arguments = f"{_value(value.args, seen)} {_value(value.keywords, seen)}"
        return f"partial {_value(value.func, seen, functions)} {arguments}"
    plain = plain_data(value, _VALUE_MAX_CHARS)
    if plain is not NOT_PLAIN:
        return json.dumps(plain, sort_keys=True)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"
