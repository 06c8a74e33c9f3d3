"""The public API changes only on purpose: this list is the contract of `import torchdata_snapshot`."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

from test_public_names import LAYER_NAMES, PUBLIC_NAMES

import torchdata_snapshot

#: The names of test_public_names, plus ProtocolError (public here; not in torchdata's tree) and the
#: elastic names, which the package has whenever its elastic/ folder is there (test_elastic.py).
EXPECTED_PUBLIC_NAMES = sorted(
    [*PUBLIC_NAMES, *LAYER_NAMES, "ProtocolError", "gather_elastic_state", "register_elastic"]
)


def test_all_is_exactly_the_public_api() -> None:
    # Sorted, exported and documented: test_public_names.py; ProtocolError is public here only.
    assert torchdata_snapshot.__all__ == EXPECTED_PUBLIC_NAMES


def test_the_package_says_it_is_typed() -> None:
    from importlib import resources

    assert resources.files("torchdata_snapshot").joinpath("py.typed").is_file()


#: Modules the package imports only for the pipelines that use them, which bring them.
OPTIONAL_IMPORTS = {
    "fsspec": "open_files_by_fsspec's files",
    "dill": "a graph traversal that pickle cannot do (torch's falls back to dill too)",
    "psutil": "a worker's CPU time where /proc is not (a control wait tells busy from stuck)",
}


def test_the_package_declares_every_module_it_imports() -> None:
    """``pip install torchdata_snapshot`` installs what it runs with (numpy: a tensor's bytes)."""
    imported = set()
    for path in Path(torchdata_snapshot.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"torchdata_snapshot"} - set(OPTIONAL_IMPORTS)
    requires = importlib.metadata.requires("torchdata_snapshot") or []
    declared = {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    assert third_party <= declared, f"imported but not declared: {sorted(third_party - declared)}"
