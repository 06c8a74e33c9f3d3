"""Export this package as a patch series on a torchdata checkout.

    python -m torchdata_snapshot.export_upstream PATH/TO/torchdata [--branch NAME]

On a git checkout of torchdata 0.7.1, 0.8.x or 0.9.x with a clean work tree, this creates the
branch ``NAME`` (default ``mprs-snapshot``) whose commits are the series a maintainer reviews:
each commit adds modules of this package where they belong in torchdata's tree (``SERIES`` says
which go together, ``LAYOUT`` where each goes), with its imports rewritten, and the tests that
cover them under ``test/dataloader2/snapshot/``; the last code commit makes
``torchdata.dataloader2.MultiProcessingReadingService`` this package's; a docs commit adds a page
under ``docs/source``. Then ``git format-patch <tag>..NAME`` gives the patch files, and
``pip install`` of the checkout gives a DataLoader2 that checkpoints mid-epoch.

A path that is not a torchdata checkout, a dirty tree, an unsupported version or an existing
branch are refused (:class:`ExportError`) before anything changes; a failure half-way puts the
checkout back as it was. See the docs' page for torchdata maintainers.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torchdata_snapshot

__all__ = ["LAYOUT", "SERIES", "ExportError", "export", "main"]

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
TESTS_DIR = REPO_DIR / "test" / "dataloader2"

#: Where each module of this package goes in torchdata's tree.
LAYOUT: Dict[str, str] = {
    "_compat": "torchdata/dataloader2/utils/snapshot_compat.py",
    "_constants": "torchdata/dataloader2/communication/snapshot_constants.py",
    "_errors": "torchdata/dataloader2/snapshot_errors.py",
    "_messages": "torchdata/dataloader2/communication/snapshot_messages.py",
    "_channel": "torchdata/dataloader2/communication/pipe_channel.py",
    "_digest": "torchdata/dataloader2/utils/digest.py",
    "_replay": "torchdata/dataloader2/utils/replay.py",
    "_graph": "torchdata/dataloader2/graph/snapshot_utils.py",
    "_rng": "torchdata/dataloader2/utils/rng.py",
    "_resumable": "torchdata/dataloader2/utils/resumable.py",
    "_sharding_shift": "torchdata/dataloader2/utils/sharding_shift.py",
    "_equivalents": "torchdata/dataloader2/utils/resumable_equivalents.py",
    "_state_functions": "torchdata/dataloader2/utils/state_functions.py",
    "_graph_state": "torchdata/dataloader2/utils/graph_state.py",
    "_stream": "torchdata/dataloader2/communication/stream.py",
    "_options": "torchdata/dataloader2/snapshot_options.py",
    "_outbox": "torchdata/dataloader2/communication/outbox.py",
    "_worker_snapshot": "torchdata/dataloader2/worker_snapshot.py",
    "_serving": "torchdata/dataloader2/utils/serving.py",
    "_capture": "torchdata/dataloader2/utils/capture.py",
    "_remaining": "torchdata/dataloader2/utils/remaining.py",
    "_dispatch": "torchdata/dataloader2/utils/snapshot_dispatch.py",
    "_worker": "torchdata/dataloader2/utils/snapshot_worker.py",
    "_seeds": "torchdata/dataloader2/random/seed_state.py",
    "_checkpoint": "torchdata/dataloader2/checkpoint.py",
    "_positions": "torchdata/dataloader2/communication/positions.py",
    "_worker_stream": "torchdata/dataloader2/communication/worker_stream.py",
    "_healing": "torchdata/dataloader2/communication/healing.py",
    "_links": "torchdata/dataloader2/communication/links.py",
    "_consumer": "torchdata/dataloader2/communication/consumer.py",
    "_outlet": "torchdata/dataloader2/communication/outlet.py",
    "_launcher": "torchdata/dataloader2/utils/launcher.py",
    "_in_process": "torchdata/dataloader2/in_process.py",
    "_worker_pool": "torchdata/dataloader2/worker_pool.py",
    "_elastic": "torchdata/dataloader2/elastic.py",
    "_restore_plan": "torchdata/dataloader2/restore_plan.py",
    "_runtime": "torchdata/dataloader2/runtime.py",
    "_reading_service": "torchdata/dataloader2/snapshot_reading_service.py",
}

#: Where the tests go: apart from upstream's own files, with a conftest of their own.
TEST_DESTINATION = "test/dataloader2/snapshot"

#: Test helpers, added with the first commit that has tests.
TEST_HELPERS = ("pipelines.py", "contract.py", "distributed.py")

#: Tests of this repository that are about this repository, not the code: not exported.
NOT_EXPORTED = {
    "test_public_api.py": "the add-on's own public surface",
    "test_layering.py": "the add-on's module layout",
    "test_examples.py": "the add-on's examples and docs",
    "test_benchmarks.py": "the add-on's benchmarks",
    "test_suite_options.py": "the add-on's own test command",
    "test_leak_guard.py": "needs pytest's pytester plugin",
    "test_export_upstream.py": "this exporter",
    "test_chaos.py": "the add-on's chaos script",
}


@dataclass(frozen=True)
class Commit:
    """One commit of the series: its title (what upstream's log would show), why, and what it adds."""

    title: str
    body: str
    modules: Tuple[str, ...]
    tests: Tuple[str, ...]


SERIES: Tuple[Commit, ...] = (
    Commit(
        "[DataLoader2] Add GetStateRequest/GetStateResponse and the snapshot protocol messages",
        "The messages the snapshot RFC proposed, beside PauseRequest/ResumeRequest, with those that\n"
        "streaming under credit and restore need, as small frozen dataclasses. NOTE [ Snapshot\n"
        "protocol ] in snapshot_messages.py describes who sends what, when. Also: the exception\n"
        "hierarchy, the time bounds of every wait, and the few private APIs the series relies on.",
        ("_compat", "_constants", "_errors", "_messages"),
        ("test_messages.py", "test_errors.py"),
    ),
    Commit(
        "[DataLoader2] Add a pipe channel with bounded waits and liveness checks",
        "One OS pipe per direction: a dead peer reads as end-of-file, every wait has a timeout after\n"
        "which the other side is checked (a worker watches the training process, also under\n"
        "forkserver), items are pickled one by one so that a batch can be bounded by bytes.",
        ("_channel",),
        ("test_channel.py",),
    ),
    Commit(
        "[DataLoader2] Add running digests of item streams, checked by replay",
        "A restore by replay must reproduce the items the user already received: every stream folds\n"
        "each item into a 64-bit running digest, and a replay that ends with another one raises\n"
        "ReplayDivergenceError instead of handing out other data.",
        ("_digest", "_replay"),
        ("test_digest.py",),
    ),
    Commit(
        "[DataLoader2] Add resumable equivalents of DataPipes and graph state capture",
        "A worker whose whole graph can report and load its state resumes from a captured state in\n"
        "time independent of the position: resumable IterableWrapper, Shuffler, UnBatcher,\n"
        "FlatMapper, Header, Cycler, Concater, Multiplexer, FileLister; the global RNG states; any\n"
        "DataPipe with state_dict()/load_state_dict(), or whose type has registered state functions\n"
        "(recorded on the class, sent to each worker with its graph). Each worker keeps its graph's\n"
        "states in a GraphState of its own.",
        (
            "_graph",
            "_rng",
            "_resumable",
            "_sharding_shift",
            "_equivalents",
            "_state_functions",
            "_graph_state",
        ),
        ("test_rng.py", "test_stateful.py", "test_stateful_equivalence.py"),
    ),
    Commit(
        "[DataLoader2] Add an outbox thread that streams a worker's items as soon as they exist",
        "Items are batched by what accumulated while the previous message was written, so slow items\n"
        "go one by one, tiny items in batches, and no item waits for the next one.",
        ("_stream", "_options", "_outbox"),
        ("test_outbox.py",),
    ),
    Commit(
        "[DataLoader2] Add worker and dispatching loops that answer GetStateRequest",
        "One serving loop per process maps each request type to its handler; the worker produces\n"
        "under credit and answers between two items, so a snapshot is consistent without a pause\n"
        "round trip; the dispatching process deals item j to worker j % N. Each item carries how\n"
        "many elements the sharding filter had taken, and an elastic epoch deals only what remains.",
        ("_worker_snapshot", "_serving", "_capture", "_dispatch", "_remaining", "_worker"),
        ("test_worker.py", "test_dispatch.py", "test_capture.py"),
    ),
    Commit(
        "[DataLoader2] Add a versioned, plain-data checkpoint of the reading service",
        "Counters, seeds, running digests and per-worker graph states: it survives torch.save and\n"
        "pickle, does not grow with the position, and is validated before any process starts.",
        ("_seeds", "_checkpoint"),
        ("test_checkpoint.py", "test_seeds.py"),
    ),
    Commit(
        "[DataLoader2] Add a consumer of worker streams with exact counts and self-healing",
        "Replaces _IterateQueueDataPipes for the new reading service: a round-robin over one record\n"
        "per worker stream, credit-based prefetching, every exchange bounded, a dead worker replaced\n"
        "when asked; the outlet counts what reached the user.",
        ("_positions", "_worker_stream", "_healing", "_links", "_consumer", "_outlet"),
        ("test_consumer.py", "test_outlet.py", "test_stream.py"),
    ),
    Commit(
        "[DataLoader2] Add a checkpointable MultiProcessingReadingService with snapshot()",
        "snapshot() returns one WorkerSnapshot per worker (the RFC); checkpoint()/restore() make\n"
        "DataLoader2.state_dict(), from_state() and load_state_dict() resume mid-epoch exactly, with\n"
        "prefetching on; faults end in clear exceptions. The exact-resume contract is tested against\n"
        "an uninterrupted run in fresh processes. With elastic=True an epoch resumes with another\n"
        "num_workers or world size, each remaining element exactly once.",
        (
            "_launcher",
            "_elastic",
            "_restore_plan",
            "_runtime",
            "_in_process",
            "_worker_pool",
            "_reading_service",
        ),
        (
            "test_reading_service.py",
            "test_exit.py",
            "test_elastic.py",
            "test_restore_plan.py",
            "test_restore.py",
            "test_stateful_restore.py",
            "test_faults.py",
            "test_self_healing.py",
            "test_transport.py",
            "test_distributed.py",
            "test_upstream_semantics.py",
            "test_contract.py",
            "test_contract_property.py",
            "test_checkpoint_fuzz.py",
        ),
    ),
)

#: Public names of this package that torchdata.dataloader2 does not export beside its own: the
#: reading service takes upstream's class's place under upstream's name, and ``ProtocolError``
#: (a message out of turn between our own processes) stays in its module.
NOT_REEXPORTED = ("MultiProcessingReadingService", "ProtocolError")

SUPPORTED = re.compile(r"^0\.(7\.1|8\.\d+|9\.\d+)$")


class ExportError(Exception):
    """The checkout cannot take the series; nothing was changed."""


# --- rewriting ----------------------------------------------------------------------------------


def dotted(module: str) -> str:
    """``_consumer`` -> ``torchdata.dataloader2.communication.consumer``."""
    return LAYOUT[module][: -len(".py")].replace("/", ".")


def public_name_modules() -> Dict[str, str]:
    """Each name ``torchdata_snapshot`` exports -> the module of this package defining it."""
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    names: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchdata_snapshot."):
            for alias in node.names:
                names[alias.asname or alias.name] = node.module.rsplit(".", 1)[1]
    return names


def public_exports() -> List[str]:
    """The public names of this package that torchdata.dataloader2 exports at the end, sorted."""
    return sorted(set(public_name_modules()) - set(NOT_REEXPORTED))


_MODULE_REFERENCE = re.compile(r"torchdata_snapshot\.(_[a-z_]+)\b")


def rewrite(source: str) -> str:
    """``source`` with every reference to this package's modules and names made torchdata's."""
    public = public_name_modules()
    lines = source.splitlines(keepends=True)
    # Import statements of the package's names or modules: rewritten statement by statement.
    edits: List[Tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and [a.name for a in node.names] == ["torchdata_snapshot"]:
            # `import torchdata_snapshot` imports everything: the reading service's module does.
            indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)  # type: ignore[union-attr]
            edits.append(
                (
                    node.lineno - 1,
                    node.end_lineno or node.lineno,
                    f"{indent}import {dotted('_reading_service')}\n",
                )
            )
            continue
        if not (isinstance(node, ast.ImportFrom) and node.module == "torchdata_snapshot"):
            continue
        by_module: Dict[str, List[str]] = {}
        for alias in node.names:
            if alias.name in LAYOUT:  # `from torchdata_snapshot import _messages as m`
                parent, leaf = dotted(alias.name).rsplit(".", 1)
                by_module.setdefault(parent, []).append(f"{leaf} as {alias.asname or alias.name}")
            else:
                spelled = alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"
                by_module.setdefault(dotted(public[alias.name]), []).append(spelled)
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)  # type: ignore[union-attr]
        statements = "".join(
            _import_statement(module, names, indent) + "\n" for module, names in sorted(by_module.items())
        )
        edits.append((node.lineno - 1, node.end_lineno or node.lineno, statements))
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start:end] = [replacement]
    text = "".join(lines)
    text = _MODULE_REFERENCE.sub(lambda m: dotted(m.group(1)) if m.group(1) in LAYOUT else m.group(0), text)
    for name, module in public.items():  # e.g. "call torchdata_snapshot.register_state_functions()"
        text = re.sub(rf"\btorchdata_snapshot\.{name}\b", f"{dotted(module)}.{name}", text)
    return text


def rewrite_test(source: str) -> str:
    """A test of this repository as it runs in torchdata's tree, where this suite's command-line
    options are registered only when its folder is given to pytest."""
    text = rewrite(source)
    text = text.replace('getoption("--mp-context")', 'getoption("--mp-context", None)')
    text = text.replace('getoption("--fuzz-examples")', 'getoption("--fuzz-examples", 40)')
    return text.replace('getoption("--full-matrix")', 'getoption("--full-matrix", False)')


def test_conftest() -> str:
    """The exported suite's conftest: this repository's two conftest files in one."""
    options = (TESTS_DIR.parent / "conftest.py").read_text()
    fixtures = (TESTS_DIR / "conftest.py").read_text()
    merged = rewrite_test(options).rstrip() + "\n\n\n# --- fixtures ---\n\n" + _body(rewrite_test(fixtures))
    merged = merged.replace(
        "    settings.load_profile(",
        '    config.addinivalue_line("markers", "full_matrix: the exhaustive contract matrix")\n'
        '    config.addinivalue_line("markers", "slow: tests that take more than a few seconds")\n'
        "    settings.load_profile(",
    )
    return merged


def _body(source: str) -> str:
    """``source`` without its module docstring and ``from __future__`` import (for merging)."""
    tree = ast.parse(source)
    skip = 0
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        skip = tree.body[0].end_lineno or 0
    lines = source.splitlines(keepends=True)[skip:]
    return "".join(line for line in lines if line.strip() != "from __future__ import annotations").lstrip()


# --- checks -------------------------------------------------------------------------------------


def module_imports(module: str) -> Set[str]:
    """The modules of this package that ``module`` imports."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse((PACKAGE_DIR / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchdata_snapshot."):
            found.add(node.module.rsplit(".", 1)[1])
    return found - {module}


def check_series() -> None:
    """Every module is exported once, in a commit after every module it imports; every test is
    exported once or said not to be. Raises ``AssertionError`` naming what does not fit."""
    modules = sorted(p.stem for p in PACKAGE_DIR.glob("_*.py") if p.stem != "__init__")
    assert sorted(LAYOUT) == modules, f"LAYOUT must place every module: {sorted(set(modules) ^ set(LAYOUT))}"
    seen: Set[str] = set()
    for commit in SERIES:
        for module in commit.modules:
            assert module not in seen, f"{module} is exported twice"
            missing = module_imports(module) - seen - set(commit.modules)
            assert not missing, f"{module} ({commit.title}) imports {sorted(missing)}, exported later"
        seen.update(commit.modules)
    assert seen == set(LAYOUT), f"modules in no commit: {sorted(set(LAYOUT) - seen)}"
    tests = sorted(p.name for p in TESTS_DIR.glob("test_*.py"))
    exported = [name for commit in SERIES for name in commit.tests]
    assert len(exported) == len(set(exported)), "a test is exported twice"
    unplaced = set(tests) - set(exported) - set(NOT_EXPORTED)
    assert not unplaced, f"tests in no commit: {sorted(unplaced)}"


# --- git ----------------------------------------------------------------------------------------


def _git(checkout: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed in {checkout}: {done.stderr.strip()}")
    return done.stdout.strip()


def _version(checkout: Path) -> str:
    if not checkout.is_dir():
        raise ExportError(f"{checkout} is not a directory")
    needed = ("version.txt", "torchdata/dataloader2/reading_service.py", "torchdata/dataloader2/__init__.py")
    absent = [name for name in needed if not (checkout / name).is_file()]
    if absent:
        raise ExportError(f"{checkout} is not a torchdata checkout: no {', '.join(absent)}")
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=checkout, capture_output=True).returncode:
        raise ExportError(f"{checkout} is not a git checkout of torchdata (no .git)")
    raw = (checkout / "version.txt").read_text().strip()
    version = re.split(r"[a-z+]", raw, maxsplit=1)[0]
    if not SUPPORTED.match(version):
        raise ExportError(
            f"torchdata {raw} is not supported: the series is made for torchdata 0.7.1, 0.8.x and 0.9.x"
        )
    return version


def check_checkout(checkout: Path, branch: str) -> str:
    """Refuse, before changing anything, a checkout that cannot take the series; its version."""
    version = _version(checkout)
    if _git(checkout, "status", "--porcelain"):
        raise ExportError(f"the work tree of {checkout} is not clean: commit or stash your changes first")
    if (
        subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}"], cwd=checkout
        ).returncode
        == 0
    ):
        raise ExportError(f"{checkout} already has a branch {branch!r}: pass another --branch or delete it")
    return version


def _commit(checkout: Path, paths: Sequence[str], title: str, body: str, version: str) -> None:
    _git(checkout, "add", *paths)
    trailer = (
        f"Generated from torchdata_snapshot {torchdata_snapshot.__version__} by "
        f"`python -m torchdata_snapshot.export_upstream`, on torchdata {version}."
    )
    identity = []
    if not _git(checkout, "config", "user.name", check=False):
        identity = ["-c", "user.name=torchdata_snapshot", "-c", "user.email=torchdata-snapshot@localhost"]
    _git(checkout, *identity, "commit", "-q", "-m", f"{title}\n\n{body}\n\n{trailer}")


def _write(checkout: Path, relative: str, text: str) -> str:
    path = checkout / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return relative


def _import_statement(module: str, names: Sequence[str], indent: str = "") -> str:
    """``from module import names``, parenthesized one name a line when it would be long."""
    line = f"{indent}from {module} import {', '.join(names)}"
    if len(line) <= 100:
        return line
    listed = "".join(f"{indent}    {name},\n" for name in names)
    return f"{indent}from {module} import (\n{listed}{indent})"


def _dataloader2_init(source: str) -> str:
    """torchdata.dataloader2's __init__ with MultiProcessingReadingService and the public names of
    the series imported from their modules (upstream keeps ``__all__`` sorted)."""
    public = public_name_modules()
    imports = [f"from {dotted('_reading_service')} import MultiProcessingReadingService  # noqa: F811"]
    by_module: Dict[str, List[str]] = {}
    exports = public_exports()
    for name in exports:
        by_module.setdefault(dotted(public[name]), []).append(name)
    imports += [_import_statement(module, names) for module, names in sorted(by_module.items())]
    anchor = "from torchdata.dataloader2.shuffle_spec import ShuffleSpec\n"
    if anchor not in source:
        raise ExportError("torchdata/dataloader2/__init__.py does not import ShuffleSpec where expected")
    source = source.replace(anchor, anchor + "\n".join(imports) + "\n", 1)
    match = re.search(r"__all__ = \[(.*?)\]", source, re.S)
    if match is None:
        raise ExportError("torchdata/dataloader2/__init__.py has no __all__ list")
    names = sorted(set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"', match.group(1))) | set(exports))
    listing = "__all__ = [\n" + "".join(f'    "{name}",\n' for name in names) + "]"
    return source[: match.start()] + listing + source[match.end() :]


#: The page the docs commit adds to torchdata's docs (written for them, kept in this repository).
UPSTREAM_DOCS_PAGE = REPO_DIR / "docs" / "upstream" / "reading_service_checkpointing.rst"


def export(checkout: Path, branch: str = "mprs-snapshot") -> List[str]:
    """Create ``branch`` on ``checkout`` with the series; return the new commits' hashes."""
    if not TESTS_DIR.is_dir() or not UPSTREAM_DOCS_PAGE.is_file():
        raise ExportError(
            f"the series is made from a clone of the torchdata_snapshot repository (its tests and docs): "
            f"{TESTS_DIR} is missing; run this from such a clone (pip install -e .)"
        )
    check_series()
    checkout = checkout.resolve()
    version = check_checkout(checkout, branch)
    start = _git(checkout, "rev-parse", "HEAD")
    previous = _git(checkout, "rev-parse", "--abbrev-ref", "HEAD")
    _git(checkout, "checkout", "-q", "-b", branch)
    try:
        first_tests = True
        for commit in SERIES:
            paths = [
                _write(checkout, LAYOUT[module], rewrite((PACKAGE_DIR / f"{module}.py").read_text()))
                for module in commit.modules
            ]
            if commit.tests and first_tests:
                paths.append(_write(checkout, f"{TEST_DESTINATION}/conftest.py", test_conftest()))
                for helper in TEST_HELPERS:
                    paths.append(
                        _write(
                            checkout,
                            f"{TEST_DESTINATION}/{helper}",
                            rewrite_test((TESTS_DIR / helper).read_text()),
                        )
                    )
                first_tests = False
            for test in commit.tests:
                paths.append(
                    _write(
                        checkout, f"{TEST_DESTINATION}/{test}", rewrite_test((TESTS_DIR / test).read_text())
                    )
                )
            _commit(checkout, paths, commit.title, commit.body, version)
        init = checkout / "torchdata/dataloader2/__init__.py"
        init.write_text(_dataloader2_init(init.read_text()))
        _commit(
            checkout,
            ["torchdata/dataloader2/__init__.py"],
            "[DataLoader2] Make the checkpointable MultiProcessingReadingService the default",
            "torchdata.dataloader2.MultiProcessingReadingService is now the one whose snapshot() reports\n"
            "each worker and whose checkpoints resume mid-epoch; the snapshot types, options and errors\n"
            "are exported beside it. Upstream's test/dataloader2 suite passes with it.",
            version,
        )
        docs = checkout / "docs" / "source"
        if (docs / "index.rst").is_file():
            page = _write(
                checkout, "docs/source/reading_service_checkpointing.rst", UPSTREAM_DOCS_PAGE.read_text()
            )
            index = (docs / "index.rst").read_text()
            if "   reading_service.rst\n" in index:
                index = index.replace(
                    "   reading_service.rst\n",
                    "   reading_service.rst\n   reading_service_checkpointing.rst\n",
                    1,
                )
            else:
                index += "\n.. toctree::\n   :maxdepth: 2\n\n   reading_service_checkpointing.rst\n"
            (docs / "index.rst").write_text(index)
            _commit(
                checkout,
                [page, "docs/source/index.rst"],
                "[Docs] Document mid-epoch checkpointing with MultiProcessingReadingService",
                "What a checkpoint guarantees, how to take and restore one, snapshot(), the options,\n"
                "and what the errors mean.",
                version,
            )
        return _git(checkout, "rev-list", "--reverse", f"{start}..{branch}").split()
    except BaseException:
        _git(checkout, "checkout", "-q", "-f", start if previous == "HEAD" else previous, check=False)
        _git(checkout, "clean", "-q", "-fd", check=False)
        _git(checkout, "branch", "-q", "-D", branch, check=False)
        raise


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchdata_snapshot.export_upstream", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkout", type=Path, help="a git checkout of torchdata (v0.7.1, v0.8.0 or v0.9.0)")
    parser.add_argument(
        "--branch", default="mprs-snapshot", help="the branch to create (default: mprs-snapshot)"
    )
    args = parser.parse_args(argv)
    try:
        commits = export(args.checkout, args.branch)
    except ExportError as e:
        print(f"export_upstream: {e}", file=sys.stderr)
        return 2
    print(f"branch {args.branch} of {args.checkout}: {len(commits)} commits")
    for sha in commits:
        print(" ", _git(args.checkout.resolve(), "log", "-1", "--format=%h %s", sha))
    print(f"patch files: git -C {args.checkout} format-patch <the tag>..{args.branch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
