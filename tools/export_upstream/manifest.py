"""The series as data: ``series.toml`` says where each module of the package goes in torchdata's
tree (a new file, or merged into the upstream file it changes) and which commit carries which
modules and tests. This module reads it and checks it against the repository."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Set, Tuple

from errors import ManifestError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the repository's tooling runs on 3.11
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
REPO_DIR = HERE.parents[1]
PACKAGE = "torchdata_snapshot"
PACKAGE_DIR = REPO_DIR / PACKAGE
TESTS_DIR = REPO_DIR / "test" / "dataloader2"
#: The tests' helpers (modules of the tests that are not tests; the conftest stays in TESTS_DIR).
HELPERS_DIR = TESTS_DIR / "helpers"
MANIFEST = HERE / "series.toml"
#: Our code that goes at named places of upstream's files, and the PRs' descriptions.
FRAGMENTS_DIR = HERE / "rfc"
PULL_REQUESTS_DIR = HERE / "prs"

#: ``test_worker.py`` (the whole file) or ``test_worker.py:2/3`` (its second third).
_TEST_PART = re.compile(
    r"^(?P<file>[a-z_0-9]+\.py)(?::(?:(?P<part>\d+)/(?P<parts>\d+)|without=(?P<without>[A-Za-z_0-9,]+)))?$"
)


@dataclass(frozen=True)
class Placement:
    """Where one module goes: ``path`` in torchdata's tree; ``merge`` into the upstream file there
    (its names replacing upstream's of the same name); ``in_place``, its subclasses of torchdata's
    classes whose members join those classes instead (class name -> ``path:UpstreamClass``,
    see in_place.py)."""

    module: str
    path: str
    merge: bool = False
    in_place: Tuple[Tuple[str, str], ...] = ()

    @property
    def dotted(self) -> str:
        return self.path[: -len(".py")].replace("/", ".")


@dataclass(frozen=True)
class TestPart:
    """A test file, one of ``parts`` contiguous slices of its tests (``part`` counts from 1), or the
    file ``without`` some of its tests (tests or test classes: an optional feature's, which its own
    commit adds, or those that need tables a later commit adds: the file again, without fewer or
    none), and without the helpers, tables and imports only they use."""

    file: str
    part: int = 1
    parts: int = 1
    without: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Edit:
    """A textual change to an upstream file that no module carries: ``old`` (exactly ``count``
    times in the file) becomes ``new``; with ``old`` empty, the line ``new`` is added unless it
    is there."""

    path: str
    old: str
    new: str
    count: int = 1


@dataclass(frozen=True)
class Removal:
    """Upstream's top-level definitions of ``names`` deleted from the file ``path``: what the
    series' code replaced, once nothing uses it (with the imports only they used)."""

    path: str
    names: Tuple[str, ...]


@dataclass(frozen=True)
class Commit:
    title: str
    body: str
    modules: Tuple[str, ...]
    tests: Tuple[TestPart, ...]
    helpers: Tuple[str, ...]
    edits: Tuple[Edit, ...] = ()
    #: torchdata.dataloader2 exports the public names of the modules written so far (an optional
    #: feature's pull request exports its own names).
    exports: bool = False
    #: Fragments of ``rfc/`` put at named places of upstream's files (see splice.py), and tests
    #: of ``rfc/`` that go beside upstream's own in ``test/dataloader2``.
    fragments: Tuple[str, ...] = ()
    fragment_tests: Tuple[str, ...] = ()
    #: Files of torchdata's tree this commit deletes: what the series' code replaces.
    deletes: Tuple[str, ...] = ()
    #: Definitions of upstream's files this commit deletes: what the series' code replaced.
    removals: Tuple[Removal, ...] = ()


@dataclass(frozen=True)
class PullRequest:
    """One pull request of the stack: the next ``commits`` commits, described by ``description``
    (a file of ``prs/``, a template of the PR's text) under ``title``. ``summary`` is what it adds,
    for a template that several pull requests share; ``optional``, a feature maintainers may take
    or leave (the pull requests before the first optional one are the checkpointable core)."""

    title: str
    commits: int
    description: str
    summary: str = ""
    optional: bool = False


@dataclass(frozen=True)
class Manifest:
    placements: Dict[str, Placement]
    commits: Tuple[Commit, ...]
    test_destination: str
    test_renames: Dict[str, str]
    not_exported: Dict[str, str]
    not_reexported: Tuple[str, ...]
    max_changed_lines: int
    text_rules: Tuple[Tuple[str, str], ...] = ()
    pull_requests: Tuple[PullRequest, ...] = ()
    max_pull_request_lines: int = 3000

    def placement(self, module: str) -> Placement:
        return self.placements[module]

    def test_name(self, file: str) -> str:
        return self.test_renames.get(file, file)

    @property
    def core_pull_requests(self) -> int:
        """How many pull requests come before the optional ones: the checkpointable core."""
        return sum(not pr.optional for pr in self.pull_requests)


def _test_part(spec: str) -> TestPart:
    match = _TEST_PART.match(spec)
    if match is None:
        raise ManifestError(
            f"{spec!r} is not 'test_x.py', 'test_x.py:PART/PARTS' or 'test_x.py:without=test_a,test_b'"
        )
    if match.group("without") is not None:
        return TestPart(match.group("file"), without=tuple(match.group("without").split(",")))
    if match.group("part") is None:
        return TestPart(match.group("file"))
    part, parts = int(match.group("part")), int(match.group("parts"))
    if not 1 <= part <= parts:
        raise ManifestError(f"{spec!r}: part {part} of {parts} does not exist")
    return TestPart(match.group("file"), part, parts)


def load(path: Path = MANIFEST) -> Manifest:
    """Read ``series.toml``; :class:`ManifestError` names what is malformed."""
    try:
        data = tomllib.loads(path.read_text())
        placements = {
            module: Placement(module, **{**fields, "in_place": tuple(fields.get("in_place", {}).items())})
            for module, fields in data["placement"].items()
        }
        commits = tuple(
            Commit(
                title=entry["title"],
                body=entry["body"].strip(),
                modules=tuple(entry.get("modules", ())),
                tests=tuple(_test_part(spec) for spec in entry.get("tests", ())),
                helpers=tuple(entry.get("helpers", ())),
                edits=tuple(Edit(**edit) for edit in entry.get("edits", ())),
                exports=bool(entry.get("exports", False)),
                fragments=tuple(entry.get("fragments", ())),
                fragment_tests=tuple(entry.get("fragment_tests", ())),
                deletes=tuple(entry.get("deletes", ())),
                removals=tuple(
                    Removal(removal["path"], tuple(removal["names"])) for removal in entry.get("removals", ())
                ),
            )
            for entry in data["commit"]
        )
        tests = data["tests"]
        return Manifest(
            placements=placements,
            commits=commits,
            test_destination=tests["destination"],
            test_renames=dict(tests.get("rename", {})),
            not_exported=dict(tests.get("not_exported", {})),
            not_reexported=tuple(data["not_reexported"]),
            max_changed_lines=int(data["max_changed_lines"]),
            text_rules=tuple((rule["pattern"], rule["replacement"]) for rule in data.get("text", ())),
            pull_requests=tuple(PullRequest(**entry) for entry in data.get("pr", ())),
            max_pull_request_lines=int(data.get("max_pull_request_lines", 3000)),
        )
    except (KeyError, TypeError, tomllib.TOMLDecodeError) as e:
        raise ManifestError(f"{path} is malformed: {type(e).__name__}: {e}") from e


def module_path(module: str) -> Path:
    """The file of one of the package's modules, named as ``placement`` names them: its path in
    the package, dotted (``core.messages``, ``_errors``)."""
    return PACKAGE_DIR / (module.replace(".", "/") + ".py")


def package_modules() -> Set[str]:
    """Every module of the package, dotted, but its ``__init__`` files (the top one is
    torchdata.dataloader2; those of the folders hold a docstring)."""
    return {
        ".".join(p.relative_to(PACKAGE_DIR).with_suffix("").parts)
        for p in PACKAGE_DIR.rglob("*.py")
        if p.name != "__init__.py"
    }


def module_imports(module: str) -> Set[str]:
    """The package's modules that ``module`` imports."""
    return _package_imports(module_path(module)) - {module}


def _package_imports(path: Path, top_level_only: bool = False) -> Set[str]:
    """The package's modules ``path`` imports (``import torchdata_snapshot`` is torchdata.dataloader2,
    there at every commit); with ``top_level_only``, those it imports when it is imported."""
    found: Set[str] = set()
    public = public_name_modules()
    tree = ast.parse(path.read_text())
    for node in tree.body if top_level_only else _run_time_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"{PACKAGE}."):
            inside = node.module[len(PACKAGE) + 1 :]
            if module_path(inside).is_file():  # from torchdata_snapshot.core.messages import X
                found.add(inside)
            else:  # from torchdata_snapshot.core import messages
                found.update(f"{inside}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            for alias in node.names:
                found.add(alias.name if alias.name.startswith("_") else public.get(alias.name, "__init__"))
    return found


def _run_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (annotations may name the
    types of modules exported later: they are never imported)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from _run_time_nodes(ast.Module(body=node.orelse, type_ignores=[]))
            continue
        yield node
        yield from _run_time_nodes(node)


def test_source(name: str) -> Path:
    """Where a file of the tests is: a helper in HELPERS_DIR, a test (or the conftest) in TESTS_DIR."""
    helper = HELPERS_DIR / name
    return helper if helper.is_file() else TESTS_DIR / name


def helper_files(file: str, text: Optional[str] = None) -> Set[str]:
    """The test helpers (modules of the test folder that are not tests) ``file`` imports (or
    ``text``, what is exported of it): through any import of the test itself, through the
    module-level imports of the helpers."""
    found: Set[str] = set()
    todo = [file]
    while todo:
        name = todo.pop()
        tree = ast.parse(text if name == file and text is not None else test_source(name).read_text())
        for node in ast.walk(tree) if name == file else tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for n in names:
                    if n and test_source(f"{n}.py").is_file() and f"{n}.py" not in found:
                        found.add(f"{n}.py")
                        todo.append(f"{n}.py")
    return found


def test_imports(file: str) -> Set[str]:
    """The package's modules a test file needs, itself or through the test helpers it imports."""
    needed = _package_imports(TESTS_DIR / file)
    for helper in helper_files(file):
        needed |= _package_imports(test_source(helper), top_level_only=True)
    return needed


def public_name_modules() -> Dict[str, str]:
    """Each name the package exports -> the module of the package that defines it."""
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    names: Dict[str, str] = {}
    for node in ast.walk(tree):  # an optional feature's names are imported in a try
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"{PACKAGE}."):
            for alias in node.names:
                names[alias.asname or alias.name] = node.module[len(PACKAGE) + 1 :]
    return names


def check(manifest: Manifest) -> None:
    """Every module placed once, in a commit after every module it imports; every test exported
    (all its parts, in order) after the modules and helpers it needs, or said not to be."""
    modules = sorted(package_modules())
    if sorted(manifest.placements) != modules:
        raise ManifestError(
            f"[placement] must place every module: {sorted(set(modules) ^ set(manifest.placements))}"
        )
    # Several modules may merge into one of torchdata's files, each adding its names; a file of
    # its own holds one module.
    paths = [p.path for p in manifest.placements.values()]
    shared = {path for path in paths if paths.count(path) > 1}
    if any(not p.merge for p in manifest.placements.values() if p.path in shared):
        raise ManifestError("two modules are placed at the same path, not both merged into it")
    done: Set[str] = {"__init__"}
    public = {n: m for n, m in public_name_modules().items() if n not in manifest.not_reexported}
    names_exported: Set[str] = set()
    helpers_done: Set[str] = set()
    parts_done: Dict[str, int] = {}
    withheld: Dict[str, Set[str]] = {}  # file -> the tests its last commit left out
    for commit in manifest.commits:
        for module in commit.modules:
            if module in done:
                raise ManifestError(f"{module} is exported twice")
            missing = module_imports(module) - done - set(commit.modules)
            if missing:
                raise ManifestError(f"{module} ({commit.title}) imports {sorted(missing)}, exported later")
        done.update(commit.modules)
        if commit.exports:
            if "core.reading_service" not in done:
                raise ManifestError(
                    f"{commit.title} exports the public names before the reading service exists"
                )
            fresh = {name for name, module in public.items() if module in done} - names_exported
            if not fresh:
                raise ManifestError(f"{commit.title} exports no name that is not exported already")
            names_exported |= fresh
            done.add("__init__")
        helpers_done.update(commit.helpers)
        for test in commit.tests:
            if test.file in withheld:  # the file again, with some or all of the tests it lacked
                _check_withheld(test, withheld, commit.title)
                continue
            if test.without:
                _check_withheld(test, withheld, commit.title)
            if parts_done.get(test.file, 0) != test.part - 1:
                raise ManifestError(f"{test.file} part {test.part} comes before part {test.part - 1}")
            parts_done[test.file] = test.part
            missing = test_imports(test.file) - done
            if missing and test.part == 1:
                raise ManifestError(f"{test.file} ({commit.title}) needs {sorted(missing)}, exported later")
            missing_helpers = _exported_helpers(test) - helpers_done
            if missing_helpers:
                raise ManifestError(f"{test.file} ({commit.title}) needs helpers {sorted(missing_helpers)}")
    left_out = {file: sorted(names) for file, names in withheld.items() if names}
    if left_out:
        raise ManifestError(f"tests no commit adds: {left_out}")
    if set(public) - names_exported:
        raise ManifestError(f"public names no commit exports: {sorted(set(public) - names_exported)}")
    if done - {"__init__"} != set(manifest.placements):
        raise ManifestError(f"modules in no commit: {sorted(set(manifest.placements) - done)}")
    tests = {p.name for p in TESTS_DIR.glob("test_*.py")}
    exported = set(parts_done)
    unplaced = tests - exported - set(manifest.not_exported)
    if unplaced:
        raise ManifestError(f"tests in no commit: {sorted(unplaced)}")
    for commit in manifest.commits:
        for part in commit.tests:
            if parts_done[part.file] != part.parts:
                raise ManifestError(f"{part.file} has {part.parts} parts, {parts_done[part.file]} exported")
    _check_pull_requests(manifest)


def _exported_helpers(test: TestPart) -> Set[str]:
    """The helpers what is exported of ``test`` imports: the file without the tests it leaves out
    imports none that only they used."""
    if not test.without:
        return helper_files(test.file)
    from rewrite import without_tests  # (rewrite imports this module)

    return helper_files(test.file, without_tests(test_source(test.file).read_text(), test.without))


def _check_withheld(test: TestPart, withheld: Dict[str, Set[str]], title: str) -> None:
    """``test`` leaves out tests of its file (``without``) that exist there, fewer than the file's
    previous commit left out, if any; ``withheld`` then holds what it leaves out."""
    if test.parts != 1:
        raise ManifestError(f"{test.file} ({title}): a file cut into parts cannot leave tests out")
    names = set(test.without)
    top = ast.parse(test_source(test.file).read_text()).body
    classes = [node for node in top if isinstance(node, ast.ClassDef)]
    defined = {
        node.name
        for node in top + [member for cls in classes for member in cls.body]
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    if names - defined:
        raise ManifestError(f"{test.file} ({title}) leaves out tests it lacks: {sorted(names - defined)}")
    if test.file in withheld and not names < withheld[test.file]:
        raise ManifestError(f"{test.file} ({title}) adds none of the tests it left out before")
    withheld[test.file] = names


def _check_pull_requests(manifest: Manifest) -> None:
    """The PRs cover the commits in order (the docs commit joins the last one), each described,
    and every fragment exists."""
    if not manifest.pull_requests:
        raise ManifestError("[[pr]]: the series must say which commits form which pull request")
    if any(pr.commits < 1 for pr in manifest.pull_requests):
        raise ManifestError("[[pr]]: every pull request has at least one commit")
    if sum(pr.commits for pr in manifest.pull_requests) != len(manifest.commits):
        raise ManifestError(
            f"[[pr]]: the pull requests hold {sum(pr.commits for pr in manifest.pull_requests)} "
            f"commits, the series has {len(manifest.commits)}"
        )
    optional = [pr.optional for pr in manifest.pull_requests]
    if optional != sorted(optional):
        raise ManifestError("[[pr]]: the optional pull requests come after the core's")
    for pr in manifest.pull_requests:
        if not (PULL_REQUESTS_DIR / pr.description).is_file():
            raise ManifestError(f"[[pr]] {pr.title!r}: no description {PULL_REQUESTS_DIR / pr.description}")
    for commit in manifest.commits:
        for name in commit.fragments + commit.fragment_tests:
            if not (FRAGMENTS_DIR / name).is_file():
                raise ManifestError(f"{commit.title}: no fragment {FRAGMENTS_DIR / name}")
