"""Make the series on a torchdata checkout: one git commit per ``[[commit]]`` of ``series.toml``,
then the docs commit, formatted as upstream's pre-commit formats (ufmt: black 21.12b0 and usort
1.0.0); the branches of the stack of pull requests ``[[pr]]`` says."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import manifest as manifest_module
from errors import (
    DirtyCheckoutError,
    ExportError,
    NotACheckoutError,
    SourceNotFoundError,
    ToolMissingError,
    UnsupportedVersionError,
    UpstreamLayoutError,
)
from in_place import InPlace, fragment, in_place_specs, without
from manifest import (
    FRAGMENTS_DIR,
    REPO_DIR,
    TESTS_DIR,
    Commit,
    Manifest,
    module_path,
    public_name_modules,
    test_source,
)
from rewrite import (
    _import_statement,
    _insert_imports,
    drop_unused_typing_imports,
    merge,
    rewrite,
    rewrite_test,
    test_slices,
    without_definitions,
    without_tests,
)
from splice import splice, target_of

#: A Sphinx role naming a place of torchdata's tree by its dotted path.
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc):`~?(torchdata\.[\w.]+)`")

#: The ``__all__`` list of a module's source, and a name in it.
ALL_LIST = re.compile(r"__all__ = \[(.*?)\]", re.S)
ALL_NAME = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"')

SUPPORTED = re.compile(r"^0\.(7\.1|8\.\d+|9\.\d+)$")

#: The page the docs commit adds to torchdata's docs (written for them, kept in this repository).
UPSTREAM_DOCS_PAGE = REPO_DIR / "docs" / "upstream" / "reading_service_checkpointing.rst"


def _git(checkout: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed in {checkout}: {done.stderr.strip()}")
    return done.stdout.strip()


def version_of(checkout: Path) -> str:
    """The torchdata version of ``checkout``; refuses what is not a supported torchdata checkout."""
    if not checkout.is_dir():
        raise NotACheckoutError(f"{checkout} is not a directory")
    needed = ("version.txt", "torchdata/dataloader2/reading_service.py", "torchdata/dataloader2/__init__.py")
    absent = [name for name in needed if not (checkout / name).is_file()]
    if absent:
        raise NotACheckoutError(f"{checkout} is not a torchdata checkout: no {', '.join(absent)}")
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=checkout, capture_output=True).returncode:
        raise NotACheckoutError(f"{checkout} is not a git checkout of torchdata (no .git)")
    raw = (checkout / "version.txt").read_text().strip()
    version = re.split(r"[a-z+]", raw, maxsplit=1)[0]
    if not SUPPORTED.match(version):
        raise UnsupportedVersionError(
            f"torchdata {raw} is not supported: the series is made for torchdata 0.7.1, 0.8.x and 0.9.x"
        )
    return version


def check_checkout(checkout: Path, branch: str) -> str:
    """Refuse, before changing anything, a checkout that cannot take the series; its version."""
    version = version_of(checkout)
    if _git(checkout, "status", "--porcelain", "--untracked-files=no"):
        raise DirtyCheckoutError(
            f"the work tree of {checkout} is not clean: commit or stash your changes first"
        )
    for name in (branch, f"{branch}-1"):
        exists = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"refs/heads/{name}"], cwd=checkout
        )
        if exists.returncode == 0:
            raise DirtyCheckoutError(
                f"{checkout} already has a branch {name!r}: pass another --branch or delete it"
            )
    return version


def find_tools(tools: Optional[Path]) -> Path:
    """The folder holding upstream's pinned pre-commit tools (``ufmt``, ``pyupgrade``): ``tools``,
    or where ``ufmt`` is on ``PATH``."""
    if tools is None:
        found = shutil.which("ufmt")
        tools = Path(found).parent if found else None
    missing = [name for name in ("ufmt", "pyupgrade") if tools is None or not (tools / name).is_file()]
    if tools is None or missing:
        raise ToolMissingError(
            f"{', '.join(missing)} not found: the series is formatted as upstream's pre-commit does "
            f"(pip install -r {Path(__file__).parent / 'requirements-upstream-lint.txt'}, then --tools)"
        )
    return tools


class SeriesWriter:
    """Writes the files of one commit after another on ``checkout``."""

    def __init__(self, checkout: Path, manifest: Manifest, tools: Path) -> None:
        self.checkout = checkout
        self.manifest = manifest
        self.tools = tools
        self.test_dir = checkout / manifest.test_destination
        self.public = public_name_modules()
        self.written: Set[str] = set()  # the package's modules written so far
        init = checkout / "torchdata/dataloader2/__init__.py"
        listed = ALL_LIST.search(init.read_text()) if init.is_file() else None
        # the public names torchdata.dataloader2 exports so far: upstream's (the reading service)
        self.exported: Set[str] = set(ALL_NAME.findall(listed.group(1))) if listed else set()
        self.exporting = False  # whether this commit exports the names of what it writes
        self.by_path: Dict[str, List[str]] = {}
        for module, placement in manifest.placements.items():
            self.by_path.setdefault(placement.dotted, []).append(module)

    def begin(self, commit: Commit) -> None:
        """What ``commit`` adds counts as there for every file it writes (see :meth:`references`)."""
        self.written.update(commit.modules)
        self.exporting = commit.exports

    def references(self, text: str) -> str:
        """``text`` with each Sphinx role that names a place this commit's tree lacks (a module or a
        name a later pull request adds) made a literal, and each public name not exported yet
        named in its module: at every commit a docstring's references resolve."""

        def resolved(match: re.Match[str]) -> str:
            dotted = self._present(match.group(1))
            if dotted is None:
                return f"``{match.group(1)}``"
            return match.group(0).replace(match.group(1), dotted)

        return ROLE.sub(resolved, text)

    def _present(self, dotted: str) -> Optional[str]:
        """``dotted`` as it resolves in this commit's tree (a public name in its module until
        torchdata.dataloader2 exports it), or None if it does not."""
        parts = dotted.split(".")
        if len(parts) == 3 and parts[:2] == ["torchdata", "dataloader2"] and parts[2] in self.public:
            name, module = parts[2], self.public[parts[2]]
            if name in self.exported:
                return dotted
            if module not in self.written:
                return None
            # rewrite() names torchdata.dataloader2 only for the names it re-exports
            return dotted if self.exporting else f"{self.manifest.placement(module).dotted}.{name}"
        for n in range(len(parts), 1, -1):
            modules = self.by_path.get(".".join(parts[:n]))
            if modules is None:
                continue
            written = [m for m in modules if m in self.written]
            if not self.manifest.placement(modules[0]).merge:
                return dotted if written else None
            if n == len(parts):
                return dotted
            path = self.checkout / self.manifest.placement(modules[0]).path
            texts = [path.read_text() if path.is_file() else ""]
            texts += [module_path(m).read_text() for m in written]
            defined = re.compile(rf"^(?:class |def )?{re.escape(parts[n])}\b", re.M)
            return dotted if any(defined.search(t) for t in texts) else None
        return dotted

    def _write(self, relative: str, text: str) -> str:
        path = self.checkout / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return relative

    def module(self, module: str) -> List[str]:
        """The module's file, and the upstream files its in-place classes join."""
        placement = self.manifest.placement(module)
        self.written.add(module)
        source = module_path(module).read_text()
        specs = in_place_specs(dict(placement.in_place))
        spliced = [self._in_place(source, spec) for spec in specs]
        if specs:
            source = without(source, [spec.name for spec in specs])
        ours = self.references(rewrite(source, self.manifest))
        target = self.checkout / placement.path
        if placement.merge:
            if not target.is_file():
                raise UpstreamLayoutError(f"{placement.path} does not exist in this checkout")
            text = merge(target.read_text(), ours, placement)
        else:
            if target.exists():
                raise UpstreamLayoutError(f"{placement.path} exists already in this checkout")
            text = LICENSE + ours
        return [self._write(placement.path, text), *spliced]

    def _in_place(self, source: str, spec: InPlace) -> str:
        """Subclass ``spec.name`` of ``source`` added to torchdata's class itself."""
        target = self.checkout / spec.path
        if not target.is_file():
            raise UpstreamLayoutError(f"{spec.path} does not exist in this checkout")
        ours = self.references(rewrite(fragment(source, spec), self.manifest))
        return self._write(spec.path, splice(target.read_text(), ours))

    def fragment(self, name: str) -> str:
        """Our code of ``rfc/NAME`` at its named places of the upstream file it joins."""
        fragment = (FRAGMENTS_DIR / name).read_text()
        relative = target_of(fragment)
        target = self.checkout / relative
        if not target.is_file():
            raise UpstreamLayoutError(f"{relative} does not exist in this checkout")
        return self._write(relative, splice(target.read_text(), fragment))

    def fragment_test(self, name: str) -> str:
        """A test of ``rfc/`` beside upstream's own tests."""
        relative = f"test/dataloader2/{name}"
        if (self.checkout / relative).exists():
            raise UpstreamLayoutError(f"{relative} exists already in this checkout")
        return self._write(relative, LICENSE + (FRAGMENTS_DIR / name).read_text())

    def edit(self, relative: str, old: str, new: str, count: int = 1) -> str:
        path = self.checkout / relative
        text = path.read_text() if path.is_file() else ""
        if old == "":  # add a line, unless it is there already
            if new not in text.splitlines(keepends=True):
                text = text if text.endswith("\n") or not text else text + "\n"
                return self._write(relative, text + new)
            return relative
        if text.count(old) != count:
            raise UpstreamLayoutError(
                f"{relative} does not hold {old.strip()!r} exactly {count} time(s) to change it"
            )
        return self._write(relative, text.replace(old, new))

    def remove(self, relative: str, names: Sequence[str]) -> str:
        """Delete upstream's top-level definitions of ``names`` from a file of torchdata's tree."""
        path = self.checkout / relative
        if not path.is_file():
            raise UpstreamLayoutError(f"{relative} does not exist in this checkout")
        return self._write(relative, without_definitions(path.read_text(), names))

    def delete(self, relative: str) -> str:
        """Delete a file of torchdata's tree that the series' code replaces."""
        path = self.checkout / relative
        if not path.is_file():
            raise UpstreamLayoutError(f"{relative} does not exist in this checkout, so cannot be deleted")
        path.unlink()
        return relative

    def test(self, file: str, part: int, parts: int, without: Sequence[str] = ()) -> str:
        source = rewrite_test((TESTS_DIR / file).read_text(), self.manifest)
        text = without_tests(source, without) if without else test_slices(source, parts)[part - 1]
        relative = f"{self.manifest.test_destination}/{self.manifest.test_name(file)}"
        self._check_unshadowed(relative)
        return self._write(relative, LICENSE + text)

    def _check_unshadowed(self, relative: str) -> None:
        """torchdata's test folders are not packages: pytest imports each test file by its
        basename, so two files of one name under ``test/`` fail ``pytest test`` at collection."""
        name = Path(relative).name
        same = sorted(
            str(path.relative_to(self.checkout))
            for path in (self.checkout / "test").rglob(name)
            if path != self.checkout / relative
        )
        if same:
            raise UpstreamLayoutError(
                f"{relative} would have the name of {', '.join(same)}: pytest imports both as "
                f"{Path(name).stem} and `pytest test` fails at collection; rename it in series.toml's "
                "[tests] rename"
            )

    def helper(self, file: str) -> str:
        if file == "conftest.py":
            text = _conftest(self.manifest)
        else:
            text = rewrite_test(test_source(file).read_text(), self.manifest)
        return self._write(
            f"{self.manifest.test_destination}/{self.manifest.test_name(file)}", LICENSE + text
        )

    def dataloader2_init(self) -> str:
        """``torchdata.dataloader2`` exports the public names of the modules written so far that
        it does not export yet (``__all__`` stays sorted)."""
        init = self.checkout / "torchdata/dataloader2/__init__.py"
        source = init.read_text()
        exports = sorted(
            name
            for name, module in self.public.items()
            if module in self.written and name not in {*self.manifest.not_reexported, *self.exported}
        )
        self.exported.update(exports)
        by_module: Dict[str, List[str]] = {}
        for name in exports:
            by_module.setdefault(self.manifest.placement(self.public[name]).dotted, []).append(name)
        anchor = "from torchdata.dataloader2.shuffle_spec import ShuffleSpec\n"
        if anchor not in source:
            raise UpstreamLayoutError(
                "torchdata/dataloader2/__init__.py does not import ShuffleSpec where expected"
            )
        imports = [_import_statement(module, names) for module, names in sorted(by_module.items())]
        source = source.replace(anchor, anchor + "\n".join(imports) + "\n", 1)
        match = ALL_LIST.search(source)
        if match is None:
            raise UpstreamLayoutError("torchdata/dataloader2/__init__.py has no __all__ list")
        names = sorted(set(ALL_NAME.findall(match.group(1))) | set(exports))
        listing = "__all__ = [\n" + "".join(f'    "{name}",\n' for name in names) + "]"
        init.write_text(source[: match.start()] + listing + source[match.end() :])
        return "torchdata/dataloader2/__init__.py"

    def format(self, paths: Sequence[str]) -> None:
        """As upstream's pre-commit would: pyupgrade --py37-plus, then ufmt (black and usort)."""
        python = [p for p in paths if p.endswith(".py") and (self.checkout / p).is_file()]
        if not python:
            return
        # pyupgrade exits with 1 when it rewrote a file: only its other codes are failures.
        upgraded = subprocess.run(
            [str(self.tools / "pyupgrade"), "--py37-plus", *python],
            cwd=self.checkout,
            capture_output=True,
            text=True,
        )
        for relative in python:  # the typing names pyupgrade made unused
            path = self.checkout / relative
            path.write_text(drop_unused_typing_imports(path.read_text()))
        formatted = subprocess.run(
            [str(self.tools / "ufmt"), "format", *python], cwd=self.checkout, capture_output=True, text=True
        )
        for name, done, ok in (("pyupgrade", upgraded, (0, 1)), ("ufmt", formatted, (0,))):
            if done.returncode not in ok:
                raise ExportError(f"{name} failed: {(done.stdout + done.stderr).strip()[-2000:]}")

    def commit(self, paths: Sequence[str], title: str, body: str) -> None:
        self.format(paths)
        _git(self.checkout, "add", "-A", "--", *paths)  # (-A: a deleted file's removal too)
        identity: List[str] = []
        if not _git(self.checkout, "config", "user.name", check=False):
            identity = ["-c", "user.name=DataLoader2 contributor", "-c", "user.email=dataloader2@localhost"]
        _git(self.checkout, *identity, "commit", "-q", "-m", f"{title}\n\n{body}")


LICENSE = (
    "# Copyright (c) Meta Platforms, Inc. and affiliates.\n"
    "# All rights reserved.\n"
    "#\n"
    "# This source code is licensed under the BSD-style license found in the\n"
    "# LICENSE file in the root directory of this source tree.\n\n"
)


def _conftest(manifest: Manifest) -> str:
    """The exported tests' conftest: the repository's two conftest files in one."""
    options = rewrite_test((TESTS_DIR.parent / "conftest.py").read_text(), manifest)
    fixtures = _body(rewrite_test((TESTS_DIR / "conftest.py").read_text(), manifest))
    # The fixtures' imports join the options' (once each), at the top.
    tree = ast.parse(fixtures)
    lines = fixtures.splitlines(keepends=True)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    statements = ["".join(lines[n.lineno - 1 : n.end_lineno]).rstrip() for n in imports]
    for node in reversed(imports):
        del lines[node.lineno - 1 : node.end_lineno]
    new = [st for st in statements if st not in options]
    if new:
        options = _insert_imports(options, "\n".join(new))
    merged = options.rstrip() + "\n\n\n# --- fixtures ---\n\n" + "".join(lines).lstrip()
    # torchdata has no pytest configuration of its own: the markers are registered here.
    if merged.count(CONFIGURE) != 1:
        raise UpstreamLayoutError(f"the tests' conftest.py must define {CONFIGURE.strip()!r} once")
    return merged.replace(CONFIGURE, CONFIGURE + "".join(MARKERS))


#: Where the exported conftest registers the suite's markers.
CONFIGURE = "def pytest_configure(config: pytest.Config) -> None:\n"
MARKERS = (
    '    config.addinivalue_line("markers", "full_matrix: the exhaustive contract matrix")\n',
    '    config.addinivalue_line("markers", "slow: tests that take more than a few seconds")\n',
)


def _body(source: str) -> str:
    """``source`` without its module docstring and ``from __future__`` import (for merging)."""
    tree = ast.parse(source)
    skip = 0
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        skip = tree.body[0].end_lineno or 0
    lines = source.splitlines(keepends=True)[skip:]
    return "".join(line for line in lines if line.strip() != "from __future__ import annotations").lstrip()


def _docs(writer: SeriesWriter) -> Optional[List[str]]:
    docs = writer.checkout / "docs" / "source"
    if not (docs / "index.rst").is_file():
        return None
    page = writer._write("docs/source/reading_service_checkpointing.rst", UPSTREAM_DOCS_PAGE.read_text())
    paths = [page]
    index = (docs / "index.rst").read_text()
    if "   reading_service.rst\n" in index:
        index = index.replace(
            "   reading_service.rst\n", "   reading_service.rst\n   reading_service_checkpointing.rst\n", 1
        )
    else:
        index += "\n.. toctree::\n   :maxdepth: 2\n\n   reading_service_checkpointing.rst\n"
    paths.append(writer._write("docs/source/index.rst", index))
    api = docs / "dataloader2.rst"
    if api.is_file():
        text = api.read_text()
        names = sorted(set(writer.public) - set(writer.manifest.not_reexported))
        entries = "".join(f"    {name}\n" for name in names)
        text = text.rstrip("\n") + (
            "\n\nCheckpointing mid-epoch\n-----------------------\n\n"
            "``MultiProcessingReadingService.snapshot()`` reports each worker's state, and "
            "``DataLoader2.state_dict()`` resumes an epoch where it stopped "
            "(see `checkpointing <reading_service_checkpointing.html>`_).\n\n"
            ".. autosummary::\n    :nosignatures:\n    :template: class_method_template.rst\n"
            "    :toctree: generated/\n\n" + entries
        )
        paths.append(writer._write("docs/source/dataloader2.rst", text))
    return paths


def export(
    checkout: Path,
    branch: str = "mprs-snapshot",
    tools: Optional[Path] = None,
    manifest: Optional[Manifest] = None,
) -> List[str]:
    """Create ``branch`` on ``checkout`` with the series; return the new commits' hashes."""
    if not TESTS_DIR.is_dir() or not UPSTREAM_DOCS_PAGE.is_file():
        raise SourceNotFoundError(
            f"the series is made from a clone of this repository (its tests and docs): {TESTS_DIR} is missing"
        )
    manifest = manifest or manifest_module.load()
    manifest_module.check(manifest)
    checkout = checkout.resolve()
    check_checkout(checkout, branch)
    tools = find_tools(tools)
    start = _git(checkout, "rev-parse", "HEAD")
    previous = _git(checkout, "rev-parse", "--abbrev-ref", "HEAD")
    _git(checkout, "checkout", "-q", "-b", branch)
    writer = SeriesWriter(checkout, manifest, tools)
    try:
        for commit in manifest.commits:
            paths = _commit_files(writer, commit)
            writer.commit(paths, commit.title, commit.body)
        docs = _docs(writer)
        if docs:
            writer.commit(
                docs,
                "[Docs] Document mid-epoch checkpointing with MultiProcessingReadingService",
                "What a checkpoint guarantees, how to take and restore one, snapshot(), the options,\n"
                "and what the errors mean; the new public names in the API reference.",
            )
        commits = _git(checkout, "rev-list", "--reverse", f"{start}..{branch}").split()
        make_stack(checkout, branch, commits, manifest)
        return commits
    except BaseException:
        _git(checkout, "checkout", "-q", "-f", start if previous == "HEAD" else previous, check=False)
        _git(checkout, "clean", "-q", "-fd", check=False)
        for name in [branch, *stack_branches(branch, len(manifest.pull_requests))]:
            _git(checkout, "branch", "-q", "-D", name, check=False)
        raise


def _commit_files(writer: SeriesWriter, commit: Commit) -> List[str]:
    writer.begin(commit)
    paths = [writer.delete(path) for path in commit.deletes]
    paths += [writer.edit(edit.path, edit.old, edit.new, edit.count) for edit in commit.edits]
    paths += [writer.remove(removal.path, removal.names) for removal in commit.removals]
    paths += [path for module in commit.modules for path in writer.module(module)]
    paths += [writer.fragment(name) for name in commit.fragments]
    if commit.exports:
        paths.append(writer.dataloader2_init())
    paths += [writer.helper(helper) for helper in commit.helpers]
    paths += [writer.test(t.file, t.part, t.parts, t.without) for t in commit.tests]
    paths += [writer.fragment_test(name) for name in commit.fragment_tests]
    return list(dict.fromkeys(paths))


def stack_branches(branch: str, count: int) -> List[str]:
    """The branches of a stack of ``count`` pull requests: ``NAME-1`` .. ``NAME-N``."""
    return [f"{branch}-{k}" for k in range(1, count + 1)]


def pull_request_commits(commits: Sequence[str], manifest: Manifest) -> List[List[str]]:
    """The commits of each pull request, in order: the next ``[[pr]].commits`` of them each (the
    docs commit, after the last ``[[commit]]``, belongs to the last pull request)."""
    groups, start = [], 0
    for k, pr in enumerate(manifest.pull_requests, 1):
        end = len(commits) if k == len(manifest.pull_requests) else start + pr.commits
        groups.append(list(commits[start:end]))
        start = end
    return groups


def make_stack(checkout: Path, branch: str, commits: Sequence[str], manifest: Manifest) -> List[str]:
    """Branches ``NAME-1`` .. ``NAME-N`` at the tips of the pull requests (``NAME-N`` is ``NAME``);
    their names."""
    names = stack_branches(branch, len(manifest.pull_requests))
    for name, mine in zip(names, pull_request_commits(commits, manifest)):
        _git(checkout, "branch", "-q", "-f", name, mine[-1])
    return names
