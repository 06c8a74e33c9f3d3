"""tools/export_upstream: the upstream patch series on a torchdata checkout (docs/maintainers.rst).

CI cannot reach torchdata's repository, so the checkout here is a git repository built from the
installed torchdata's package files plus the few top-level files a checkout has (the real
v0.7.1, v0.8.0 and v0.9.0 checkouts, with upstream's own tests and linters, are checked with
``python tools/export_upstream PATH --check``; see the maintainers page). The series is made
once per test session; the refusals work on clones of the checkout.

The series is formatted as upstream's pre-commit formats it, so the pinned tools must exist:
``scripts/test.sh`` makes them (``scripts/setup_upstream_tools.sh``). Making the series takes
minutes: the tests that need it are marked ``upstream_series``, which the default run leaves
out and CI runs (``scripts/test.sh -m upstream_series``, see ``.ci/run``).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torchdata

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "export_upstream"
TOOLS_BIN = Path(os.environ.get("UPSTREAM_TOOLS", REPO / ".venv-upstream-lint" / "bin"))
TAG = "v" + torchdata.__version__.split("+")[0]
IDENTITY = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def series_test(test: Callable[..., None]) -> Callable[..., None]:
    """A test of the series (``upstream_series``); the first one to run makes it (see ``series``),
    which takes minutes on a busy machine: it gets more than the suite's 300 s per test."""
    return pytest.mark.timeout(1200)(pytest.mark.upstream_series(test))


def tool(name: str) -> ModuleType:
    """A module of the tool (it is a folder of modules run as a script, not a package)."""
    if str(TOOL) not in sys.path:
        sys.path.insert(0, str(TOOL))
    return importlib.import_module(name)


MANIFEST = tool("manifest").load()


def pull_request(description: str) -> int:
    """The number of the pull request described by ``description`` (a file of ``prs/``)."""
    return next(k for k, pr in enumerate(MANIFEST.pull_requests, 1) if pr.description == description)


#: The pull request that switches MultiProcessingReadingService over to the streaming transport,
#: the one that makes it checkpointable mid-epoch (each description is its stage's design), and
#: the last of the core, before the optional features.
SWITCH = pull_request("2-streaming.md")
CHECKPOINTABLE = pull_request("3-checkpointable.md")
CORE = MANIFEST.core_pull_requests


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def run_tool(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "ignore", str(TOOL), *args], capture_output=True, text=True, timeout=timeout
    )


def run_in(repo: Path, code: str) -> subprocess.CompletedProcess:
    """Run Python in a process that imports torchdata from ``repo`` (before site-packages)."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-W", "ignore", "-c", code]
    return subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)


#: Code that takes a state mid-epoch from ``rs``, a 2-worker reading service over 20 items, and
#: checks that DataLoader2.from_state resumes exactly there (``d``: torchdata.dataloader2).
RESUMES_MID_EPOCH = (
    "dl = d.DataLoader2(IterableWrapper(range(20)).sharding_filter(), reading_service=rs)\n"
    "it = iter(dl); head = [next(it) for _ in range(7)]; state = dl.state_dict(); rest = list(it)\n"
    "dl.shutdown()\n"
    "again = d.DataLoader2.from_state(state, d.MultiProcessingReadingService(num_workers=2))\n"
    "assert list(again) == rest, 'resumed exactly'\n"
    "again.shutdown()\n"
)


def run_at(series: Path, tip: str, code: str) -> subprocess.CompletedProcess:
    """:func:`run_in` with ``tip`` checked out; the series' tip is checked out again after."""
    git(series, "checkout", "-q", tip)
    try:
        return run_in(series, code)
    finally:
        git(series, "checkout", "-q", "series")


def assert_pytest_passes_at(series: Path, sha: str, arguments: List[str], timeout: float) -> None:
    """pytest with ``arguments`` in the exported tree at ``sha`` (the series' tip is checked out
    again after), as upstream's CI runs it; this tool's folder is importable, for its plugins."""
    git(series, "checkout", "-q", sha)
    try:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", *arguments]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(series), str(TOOL)])}
        done = subprocess.run(command, cwd=series, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        git(series, "checkout", "-q", "series")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout


@pytest.fixture(scope="module")
def tools_bin() -> Path:
    missing = [name for name in ("ufmt", "pyupgrade", "flake8") if not (TOOLS_BIN / name).is_file()]
    assert not missing, (
        f"{missing} not in {TOOLS_BIN}: run scripts/setup_upstream_tools.sh (scripts/test.sh does)"
    )
    return TOOLS_BIN


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torchdata 'checkout' at the installed version: its package, version.txt, docs, tests."""
    repo = tmp_path_factory.mktemp("torchdata")
    shutil.copytree(
        Path(torchdata.__file__).parent,
        repo / "torchdata",
        ignore=shutil.ignore_patterns("__pycache__", "version.py"),
    )
    (repo / "version.txt").write_text(TAG[1:] + "\n")
    (repo / "docs" / "source").mkdir(parents=True)
    (repo / "docs" / "source" / "index.rst").write_text(
        ".. toctree::\n\n   dataloader2.rst\n   reading_service.rst\n"
    )
    (repo / "docs" / "source" / "dataloader2.rst").write_text("DataLoader2\n===========\n")
    (repo / "test" / "dataloader2").mkdir(parents=True)
    (repo / "test" / "requirements.txt").write_text("pytest\nexpecttest\npsutil\n")
    (repo / "test" / "dataloader2" / "test_mprs.py").write_text("# upstream's tests live here\n")
    # upstream's test folders are not packages; this name is one of upstream's tests (test/test_graph.py)
    (repo / "test" / "test_graph.py").write_text("def test_upstreams_graph():\n    pass\n")
    (repo / ".gitignore").write_text("*.so\n")
    # The formatters' settings a checkout has (black at 120 columns, usort's first-party rule).
    (repo / "pyproject.toml").write_text(
        "[tool.usort]\nfirst_party_detection = false\n\n"
        '[tool.black]\nline-length = 120\ntarget-version = ["py39"]\n'
    )
    # mypy as upstream's CI runs it: its package, untyped bodies checked, third parties untyped.
    (repo / "mypy.ini").write_text(
        "[mypy]\nfiles = torchdata\nexclude = examples, test, packaging\ncheck_untyped_defs = True\n"
        "show_error_codes = True\nignore_missing_imports = True\n"
    )
    env = {**os.environ, **IDENTITY}
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "torchdata"], ["tag", TAG]):
        subprocess.run(["git", *command], cwd=repo, check=True, env=env, capture_output=True)
    return repo


def _clone(upstream: Path, into: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(upstream), str(into)], check=True)
    for key, value in (("user.name", "t"), ("user.email", "t@t")):
        git(into, "config", key, value)
    for so in (upstream / "torchdata").glob("*.so"):  # the compiled part, not tracked
        shutil.copy(so, into / "torchdata" / so.name)
    return into


@pytest.fixture(scope="module")
def series(upstream: Path, tools_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The series, made once by the command line on a clone of the checkout."""
    checkout = _clone(upstream, tmp_path_factory.mktemp("series") / "torchdata")
    done = run_tool(str(checkout), "--branch", "series", "--tools", str(tools_bin))
    assert done.returncode == 0, done.stderr[-3000:]
    yield checkout


@pytest.fixture
def checkout(upstream: Path, tmp_path: Path) -> Path:
    return _clone(upstream, tmp_path / "torchdata")


def state(repo: Path) -> Dict[str, str]:
    """What a refused or failed export must leave as it was: HEAD, the branches, the work tree."""
    return {
        "head": git(repo, "rev-parse", "HEAD"),
        "branches": git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads"),
        "status": git(repo, "status", "--porcelain"),
    }


def test_the_manifest_places_every_module_once_after_what_it_imports() -> None:
    manifest = tool("manifest")
    manifest.check(manifest.load())


def test_the_manifest_refuses_a_module_exported_before_what_it_imports() -> None:
    manifest = tool("manifest")
    loaded = manifest.load()
    worker = next(commit for commit in loaded.commits if "core.worker.epoch" in commit.modules)
    early = (worker, *(commit for commit in loaded.commits if commit is not worker))
    with pytest.raises(tool("errors").ManifestError, match="core.worker.epoch .* imports .*exported later"):
        manifest.check(type(loaded)(**{**loaded.__dict__, "commits": early}))


def test_the_optional_pull_requests_come_after_the_core() -> None:
    manifest, loaded = tool("manifest"), MANIFEST
    assert [pr.optional for pr in loaded.pull_requests][CORE - 1 : CORE + 1] == [False, True]
    first, *rest = loaded.pull_requests
    swapped = (rest[-1], *rest[:-1], first)  # the tensor pool's first, the RFC's last
    with pytest.raises(tool("errors").ManifestError, match="optional pull requests come after the core's"):
        manifest.check(replace(loaded, pull_requests=swapped))


@series_test
def test_the_series_has_the_shape_a_reviewer_asked_for(series: Path) -> None:
    check = tool("check")
    report = check.Report()
    check.check_shape(series, TAG, "series", tool("manifest").load().max_changed_lines, report)
    assert report.problems == []
    subjects = git(series, "log", "--reverse", "--format=%s", f"{TAG}..series").splitlines()
    assert subjects[0].startswith("[DataLoader2] Answer GetStateRequest in the worker loop")
    assert subjects[-1].startswith("[Docs]")
    changed = git(series, "diff", "--name-only", f"{TAG}..series").splitlines()
    assert "test/dataloader2/test_mprs.py" not in changed, "upstream's own tests are left alone"
    assert "test/requirements.txt" not in changed, "the tests need nothing torchdata's CI lacks"
    tests = [series / path for path in changed if path.startswith("test/") and path.endswith(".py")]
    imports_hypothesis = re.compile(r"^\s*(from|import) hypothesis\b", re.M)
    assert [p for p in tests if p.exists() and imports_hypothesis.search(p.read_text())] == []


@series_test
def test_the_series_is_a_stack_of_pull_requests_the_rfc_first(series: Path) -> None:
    manifest = tool("manifest").load()
    stack = tool("series").stack_branches("series", len(manifest.pull_requests))
    check = tool("check")
    report = check.Report()
    check.check_stack(series, TAG, stack, manifest.max_pull_request_lines, report)
    assert report.problems == [], "the RFC fits in one review, and every other pull request in 3,000 lines"
    assert len(stack) >= 4 and 1 < SWITCH < CHECKPOINTABLE < CORE < len(stack), "the stages, in order"
    assert git(series, "rev-parse", stack[-1]) == git(series, "rev-parse", "series")
    for below, above in zip([TAG, *stack], stack):
        assert (
            subprocess.run(["git", "merge-base", "--is-ancestor", below, above], cwd=series).returncode == 0
        )
    rfc = git(series, "diff", "--name-only", f"{TAG}..{stack[0]}").splitlines()
    assert "torchdata/dataloader2/communication/messages.py" in rfc
    assert "test/dataloader2/test_mprs_snapshot.py" in rfc
    git(series, "checkout", "-q", stack[0])
    try:
        messages = (series / "torchdata/dataloader2/communication/messages.py").read_text()
        assert "class GetStateRequest(Request)" in messages and "class GetStateResponse(Response)" in messages
        iter_py = (series / "torchdata/dataloader2/communication/iter.py").read_text()
        assert "elif isinstance(request, communication.messages.GetStateRequest):" in iter_py
        assert not (series / "torchdata/dataloader2/communication/channel.py").exists(), "upstream's own loop"
    finally:
        git(series, "checkout", "-q", "series")


@series_test
def test_at_the_rfcs_tip_two_workers_answer_snapshot_mid_epoch(series: Path) -> None:
    code = (
        "import torchdata.dataloader2 as d\n"
        "from torchdata.datapipes.iter import IterableWrapper\n"
        "rs = d.MultiProcessingReadingService(num_workers=2, main_prefetch_cnt=0)\n"
        "dl = d.DataLoader2(IterableWrapper(range(30)).sharding_filter(), reading_service=rs)\n"
        "it = iter(dl); head = [next(it) for _ in range(11)]\n"
        "snapshots = dl.reading_service.snapshot()\n"
        "assert [s.worker_id for s in snapshots] == [0, 1], snapshots\n"
        "assert sum(s.handed_on for s in snapshots) == 11, snapshots\n"
        "assert sorted(head + list(it)) == list(range(30)), 'every item once'\n"
        "dl.shutdown()\n"
    )
    done = run_at(series, "series-1", code)
    assert done.returncode == 0, done.stderr[-3000:]


@series_test
def test_upstreams_ci_command_collects_at_the_rfcs_tip_and_the_stacks(series: Path) -> None:
    """``pytest test``, as upstream's CI runs it: no test file of the series has the name of one
    of upstream's (its test folders are not packages), and every mark is registered."""
    check = tool("check")
    assert check.collection_errors(series, TAG) == ([], [])
    for tip in ("series-1", "series"):
        assert check.collection_errors(series, tip) == ([], []), tip
    git(series, "checkout", "-q", "series")


@series_test
def test_every_file_the_stack_adds_or_changes_runs_on_python39(series: Path) -> None:
    report = tool("check").Report()
    for tip in ("series-1", "series"):
        tool("check").check_python39(series, TAG, tip, report)
    git(series, "checkout", "-q", "series")
    assert not report.problems, report.problems


@series_test
@pytest.mark.parametrize("tip", ["series-1", "series"])
def test_snapshot_holds_on_the_graphs_upstream_runs_under_spawn(series: Path, tip: str) -> None:
    """The RFC's tests (map-style DataPipes, fork/demux/mux, a dispatching process, DataPipes of
    one's own, a dead worker; fork, spawn and forkserver) at the RFC's tip and the stack's, with
    spawn, macOS's and Windows' default start method, as the default."""
    tests = ["test/dataloader2/test_mprs_snapshot.py"]
    if tip == "series-1":
        tests.append("test/dataloader2/test_get_state.py")
    assert_pytest_passes_at(series, tip, [*tests, "-p", "spawn_start"], timeout=900)


@series_test
def test_the_streaming_pull_request_snapshots_and_restarts_a_restored_epoch(series: Path) -> None:
    """At the streaming transport's tip the queue-based loop is gone and nothing checkpoints:
    snapshot() answers, DataLoader2.state_dict() records no position (a restored loader starts
    its epoch over, as with the queue-based reading service), and stateful=True is refused."""
    code = (
        "import importlib.util, torchdata.dataloader2 as d\n"
        "from torchdata.datapipes.iter import IterableWrapper\n"
        "assert importlib.util.find_spec('torchdata.dataloader2.checkpoint_session') is None\n"
        "rs = d.MultiProcessingReadingService(num_workers=2)\n"
        "dl = d.DataLoader2(IterableWrapper(range(20)).sharding_filter(), reading_service=rs)\n"
        "it = iter(dl); head = [next(it) for _ in range(7)]\n"
        "assert [s.worker_id for s in dl.reading_service.snapshot()] == [0, 1]\n"
        "state = dl.state_dict(); rest = list(it); dl.shutdown()\n"
        "assert state['reading_service_state'] is None and sorted(head + rest) == list(range(20))\n"
        "again = d.DataLoader2.from_state(state, d.MultiProcessingReadingService(num_workers=2))\n"
        "assert sorted(again) == list(range(20)), 'the epoch starts over'\n"
        "again.shutdown()\n"
        "try:\n"
        "    d.MultiProcessingReadingService(num_workers=1, stateful=True)\n"
        "except ValueError as e:\n"
        "    assert 'stateful=True needs torchdata.dataloader2.utils.stateful_worker_loop' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('stateful=True was not refused')\n"
    )
    done = run_at(series, f"series-{SWITCH}", code)
    assert done.returncode == 0, done.stderr[-3000:]


@series_test
def test_the_checkpointable_pull_request_resumes_mid_epoch_by_replay(series: Path) -> None:
    code = (
        "import importlib.util, torchdata.dataloader2 as d\n"
        "from torchdata.datapipes.iter import IterableWrapper\n"
        "assert importlib.util.find_spec('torchdata.dataloader2.utils.stateful_worker_loop') is None\n"
        "rs = d.MultiProcessingReadingService(num_workers=2)\n" + RESUMES_MID_EPOCH
    )
    done = run_at(series, f"series-{CHECKPOINTABLE}", code)
    assert done.returncode == 0, done.stderr[-3000:]


#: The optional features in torchdata's tree, each added by a pull request of its own: the
#: option that asks for one, a value that does, the module it needs.
FEATURES = [
    ("restart_dead_workers", 1, "torchdata.dataloader2.communication.healing"),
    ("elastic", True, "torchdata.dataloader2.elastic_start"),
    ("tensor_pool", True, "torchdata.dataloader2.communication.tensor_pool"),
]


@series_test
def test_the_checkpointable_pull_request_resumes_without_the_optional_features(series: Path) -> None:
    """At the tip of the core's last pull request none of the optional features' modules exists:
    an epoch resumes exactly, the pool's default quietly means off, and asking for a feature is
    refused naming its module."""
    code = (
        "import importlib.util, torchdata.dataloader2 as d\n"
        "from torchdata.datapipes.iter import IterableWrapper\n"
        f"features = {FEATURES!r}\n"
        "assert [m for _, _, m in features if importlib.util.find_spec(m)] == []\n"
        "assert not hasattr(d, 'register_elastic')\n"
        "import logging\n"
        "handlers = logging.getLogger('torchdata.dataloader2').handlers\n"
        "assert any(isinstance(h, logging.NullHandler) for h in handlers), 'a library logger'\n"
        "rs = d.MultiProcessingReadingService(num_workers=2)\n"
        + RESUMES_MID_EPOCH
        + "for option, value, module in features:\n"
        "    try:\n"
        "        d.MultiProcessingReadingService(num_workers=1, **{option: value})\n"
        "    except ValueError as e:\n"
        "        assert str(e).endswith(f'needs {module}, which this installation lacks'), e\n"
        "    else:\n"
        "        raise AssertionError(f'{option} was not refused')\n"
    )
    done = run_at(series, f"series-{CORE}", code)
    assert done.returncode == 0, done.stderr[-3000:]
    for _, _, module in FEATURES:
        assert (series / (module.replace(".", "/") + ".py")).is_file(), f"{module} at the stack's tip"


@series_test
def test_no_line_the_series_adds_says_upstream(series: Path) -> None:
    """In torchdata's tree there is no "upstream": each line names the class, loop or file it means."""
    diff = git(series, "diff", f"{TAG}..series").splitlines()
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len(added) > 10_000, "the whole series"
    assert [line for line in added if "upstream" in line.lower()] == []


#: Where the readers of torch's and torchdata's private fields go in torchdata's tree: beside the
#: class whose fields they read (or the graph's helpers, for the DataPipes' fields).
PRIVATE_FIELD_READERS = {
    "torchdata/dataloader2/dataloader2.py": ["dataloader2_started", "load_dataloader2_state"],
    "torchdata/dataloader2/random/seed_generator.py": ["seed_engine_states", "load_seed_engine_states"],
    "torchdata/dataloader2/graph/utils.py": [
        "samples_yielded",
        "iterator_id",
        "prefetcher_in_progress",
    ],
    "torchdata/dataloader2/error.py": ["ExceptionWrapper", "RemoteTraceback"],
}


@series_test
def test_no_compat_module_and_no_frame_walking_in_torchdatas_tree(series: Path) -> None:
    """In torchdata's tree the code that reads a class's private fields is in the class's module:
    no compat.py wraps them, and nothing walks the caller's frames."""
    changed = git(series, "diff", "--name-only", "--diff-filter=A", f"{TAG}..series").splitlines()
    assert [path for path in changed if "compat" in Path(path).name] == []
    diff = git(series, "diff", f"{TAG}..series").splitlines()
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert [line for line in added if re.search(r"(?<![a-z])compat(?![a-z])|_getframe", line)] == []
    for path, names in PRIVATE_FIELD_READERS.items():
        source = (series / path).read_text()
        for name in names:
            assert re.search(rf"^(def|class) {name}\b", source, re.M), f"{name} is not defined in {path}"


#: A Sphinx role naming a place by its dotted path (``:mod:`torchdata.x```, ``:class:`~torchdata.x.Y```).
DOTTED_REFERENCE = tool("series").ROLE


@series_test
@pytest.mark.parametrize("pr", range(1, len(MANIFEST.pull_requests) + 1))
def test_at_each_pull_requests_tip_the_docstrings_name_places_that_exist(series: Path, pr: int) -> None:
    """A docstring of the core names the plug-in interface, not a feature's module that a later
    pull request adds: every dotted reference the stack has added so far resolves."""
    tip = f"series-{pr}"
    diff = git(series, "diff", f"{TAG}..{tip}", "--", "torchdata").splitlines()
    added = "\n".join(line for line in diff if line.startswith("+"))
    references = sorted(set(DOTTED_REFERENCE.findall(added)))
    assert len(references) >= (20 if pr >= SWITCH else 1), references  # (the pattern finds them)
    code = (
        "import importlib, sys\n"
        "unresolved = []\n"
        f"for ref in {references!r}:\n"
        "    parts = ref.split('.')\n"
        "    for i in range(len(parts), 0, -1):\n"
        "        try:\n"
        "            found = importlib.import_module('.'.join(parts[:i]))\n"
        "        except ImportError:\n"
        "            continue\n"
        "        for name in parts[i:]:\n"
        "            found = getattr(found, name, None)\n"
        "        break\n"
        "    else:\n"
        "        found = None\n"
        "    if found is None:\n"
        "        unresolved.append(ref)\n"
        "print('\\n'.join(unresolved))\n"
    )
    done = run_at(series, tip, code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [], f"named at {tip} but not there"


@series_test
def test_every_commit_imports_on_its_own(series: Path) -> None:
    check = tool("check")
    report = check.Report()
    check.check_imports(series, TAG, "series", sys.executable, report)
    assert report.problems == []


@series_test
def test_the_series_passes_upstreams_formatters_and_flake8(series: Path, tools_bin: Path) -> None:
    files = [
        p
        for p in git(series, "diff", "--name-only", "--diff-filter=AM", f"{TAG}..series").splitlines()
        if p.endswith(".py")
    ]
    git(series, "checkout", "-q", "series")
    assert subprocess.run([str(tools_bin / "ufmt"), "check", *files], cwd=series).returncode == 0
    flake8 = subprocess.run(
        [str(tools_bin / "flake8"), *tool("check").FLAKE8_DEFAULTS, *files],
        cwd=series,
        capture_output=True,
        text=True,
    )
    assert flake8.returncode == 0, flake8.stdout[-3000:]
    upgraded = subprocess.run(
        [str(tools_bin / "pyupgrade"), "--py37-plus", *files], cwd=series, capture_output=True
    )
    assert upgraded.returncode == 0 and git(series, "status", "--porcelain") == "", (
        "pyupgrade has nothing left to do"
    )


@series_test
def test_the_series_type_checks_with_torchdatas_mypy_settings(series: Path, tools_bin: Path) -> None:
    check = tool("check")
    report = check.Report()
    files = [
        p
        for p in git(series, "diff", "--name-only", "--diff-filter=AM", f"{TAG}..series").splitlines()
        if p.endswith(".py")
    ]
    git(series, "checkout", "-q", "series")
    check.check_mypy(series, files, tools_bin, report)
    assert report.problems == [] and report.notes == ["mypy: 0 errors in the series' files"]


@series_test
def test_messages_worker_and_reading_service_change_in_place(series: Path) -> None:
    git(series, "checkout", "-q", "series")
    messages = (series / "torchdata/dataloader2/communication/messages.py").read_text()
    assert messages.count("class PauseRequest(") == 1 and "class GetStateRequest(" in messages
    worker = (series / "torchdata/dataloader2/utils/worker.py").read_text()
    assert "def prepare_worker_graph(" in worker and worker.count("def process_init_fn(") == 1
    assert "class WorkerLoop(" in (series / "torchdata/dataloader2/utils/worker_loop.py").read_text()
    untouched = git(
        series, "diff", "--name-only", f"{TAG}..series", "--", "torchdata/dataloader2/utils/__init__.py"
    )
    assert untouched == "", "the worker loop is a module of its own: no import cycle to break there"
    code = (
        "import torchdata.dataloader2 as d, torchdata.dataloader2.reading_service as r\n"
        "assert d.MultiProcessingReadingService is r.MultiProcessingReadingService\n"
        "from torchdata.dataloader2.communication import messages as m\n"
        "assert m.PauseRequest(None).pause_fn is None and m.GetNextRequest().epoch is None\n"
    )
    done = run_in(series, code)
    assert done.returncode == 0, done.stderr[-3000:]


#: What the queue-based loop was made of; the checkpointable pull request deletes it.
QUEUE_LOOP = ["eventloop", "iter", "map", "protocol", "queue"]


@series_test
@pytest.mark.parametrize("tip", [f"series-{SWITCH}", "series"])
def test_the_queue_based_loop_is_gone_and_what_used_it_still_works(series: Path, tip: str) -> None:
    git(series, "checkout", "-q", tip)
    try:
        for name in QUEUE_LOOP:
            assert not (series / f"torchdata/dataloader2/communication/{name}.py").exists(), name
        assert not (series / "test/dataloader2/test_get_state.py").exists(), "it tested that loop"
        code = (
            "import importlib, inspect, torchdata.dataloader2 as d\n"
            "from torchdata.dataloader2.utils import process_init_fn\n"
            "from torchdata.datapipes.iter import IterableWrapper\n"
            f"for name in {QUEUE_LOOP!r}:\n"
            "    try:\n"
            "        importlib.import_module('torchdata.dataloader2.communication.' + name)\n"
            "    except ModuleNotFoundError:\n"
            "        pass\n"
            "    else:\n"
            "        raise AssertionError(name)\n"
            "params = list(inspect.signature(process_init_fn).parameters)\n"
            "assert params == ['datapipe', 'worker_info', 'custom_init_fn', 'worker_prefetch_cnt'], params\n"
            "assert list(IterableWrapper(range(50)).prefetch(4)) == list(range(50))\n"
            "def absolute(dp, info):\n"
            "    return dp.map(abs)\n"
            "rs = d.InProcessReadingService(prefetch_cnt=2, init_fn=absolute)\n"
            "dl = d.DataLoader2(IterableWrapper(range(-3, 3)), reading_service=rs)\n"
            "assert list(dl) == [3, 2, 1, 0, 1, 2]\n"
            "dl.shutdown()\n"
            "rs = d.MultiProcessingReadingService(num_workers=2)\n"
            "from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES as P\n"
            "dispatched = IterableWrapper(range(10)).sharding_round_robin_dispatch(P.MULTIPROCESSING)\n"
            "dispatched = dispatched.map(abs)  # the part after the dispatching process, in the workers\n"
            "dl = d.DataLoader2(dispatched, reading_service=rs)\n"
            "assert sorted(dl) == list(range(10)), 'the dispatching process, without its queue loop'\n"
            "dl.shutdown()\n"
        )
        done = run_in(series, code)
    finally:
        git(series, "checkout", "-q", "series")
    assert done.returncode == 0, done.stderr[-3000:]


@series_test
def test_the_exported_tree_resumes_mid_epoch(series: Path) -> None:
    git(series, "checkout", "-q", "series")
    code = (
        "import torchdata.dataloader2 as d, torchdata\n"
        f"assert torchdata.__file__.startswith({str(series)!r})\n"
        "from torchdata.datapipes.iter import IterableWrapper\n"
        "rs = d.MultiProcessingReadingService(num_workers=2, multiprocessing_context='fork')\n"
        + RESUMES_MID_EPOCH
    )
    done = run_in(series, code)
    assert done.returncode == 0, done.stderr[-3000:]


@series_test
def test_torchdatas_own_datapipes_keep_their_state_in_their_classes(series: Path) -> None:
    """At the stack's tip torchdata's Header, Cycler, FlatMapper, enumerate, add_index and
    lines_to_paragraphs are resumable themselves (no subclass, no adapter), and resume a worker's
    graph from its captured states; torch's classes keep the smallest subclasses."""
    code = (
        "import pickle\n"
        "from torchdata.datapipes.iter import IterableWrapper, Header, Cycler, FlatMapper, Enumerator,"
        " IndexAdder, ParagraphAggregator, Shuffler\n"
        "from torchdata.datapipes.utils.resumable import Resumable\n"
        "from torchdata.dataloader2.utils import graph_state, resumable_datapipes\n"
        "own = [Header, Cycler, FlatMapper, Enumerator, IndexAdder, ParagraphAggregator]\n"
        "for kind in own:\n"
        "    assert issubclass(kind, Resumable) and kind.state_dict is not Resumable.state_dict, kind\n"
        "    assert kind not in graph_state.RESUMABLE_ADAPTERS, kind\n"
        "assert issubclass(resumable_datapipes.ADAPTERS[Shuffler], Shuffler)\n"
        "assert not [n for n in dir(resumable_datapipes) if n in ('ResumableHeader', 'ResumableCycler')]\n"
        "from torchdata.dataloader2.graph.datapipe_info import graph_datapipes\n"
        "build = lambda: IterableWrapper(range(5)).cycle(2).header(7).enumerate()\n"
        "state = graph_state.GraphState()\n"
        "graph = state.make_resumable(build())\n"
        "it = iter(graph)\n"
        "head = [next(it) for _ in range(4)]\n"
        "blob = state.capture(graph_datapipes(graph))\n"
        "again = graph_state.GraphState()\n"
        "fresh = again.make_resumable(build())\n"
        "again.load(graph_datapipes(fresh), blob)\n"
        "assert head + list(fresh) == list(build())\n"
    )
    done = run_in(series, code)
    assert done.returncode == 0, done.stderr[-3000:]


#: What runs where: upstream's and the series' whole test/dataloader2 at the first commit, the
#: RFC's tip (the first pull request) and the middle commit; at the tip, the reading service's
#: own tests and upstream's semantics (the rest is this repository's suite, which CI ran just
#: before).
AT_COMMIT = {
    "first": ["test/dataloader2"],
    "rfc": ["test/dataloader2"],
    "middle": ["test/dataloader2"],
    "tip": [
        "test/dataloader2/test_mprs.py",
        "test/dataloader2/snapshot/test_reading_service.py",
        "test/dataloader2/snapshot/test_dataloader2_semantics.py",
        "test/dataloader2/snapshot/test_restore.py",
        # torchdata's own DataPipes that keep their state where the package has adapters
        "test/dataloader2/snapshot/test_remaining.py",
        "test/dataloader2/snapshot/test_resumable_datapipes.py",
        "test/dataloader2/snapshot/test_resumable_accumulators.py",
    ],
}


@series_test
@pytest.mark.parametrize("where", sorted(AT_COMMIT))
def test_the_tests_pass_in_the_exported_tree(series: Path, where: str) -> None:
    commits = git(series, "rev-list", "--reverse", f"{TAG}..series").split()
    rfc = git(series, "rev-parse", "series-1")
    sha = {"first": commits[0], "rfc": rfc, "middle": commits[len(commits) // 2], "tip": commits[-1]}[where]
    assert_pytest_passes_at(series, sha, AT_COMMIT[where], timeout=1200)


@series_test
def test_each_pull_request_has_a_description_listing_its_commits(series: Path) -> None:
    manifest = tool("manifest").load()
    stack = tool("series").stack_branches("series", len(manifest.pull_requests))
    below = TAG
    for k, name in enumerate(stack, 1):
        text = (series.parent / f"PR-{k}.md").read_text()
        count = len(git(series, "rev-list", f"{below}..{name}").split())
        assert f"Branch `{name}` on `{below}`" in text and f"{count} commits" in text
        assert "release/0.9" in text and "{{" not in text, "every placeholder is filled"
        assert "torchdata_snapshot" not in text
        below = name
    first = (series.parent / "PR-1.md").read_text()
    assert "#1039" in first and "snapshot()" in first and manifest.pull_requests[1].title in first


def test_the_command_line_refuses_with_a_message_and_exit_code_2(tmp_path: Path) -> None:
    done = run_tool(str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert "is not a torchdata checkout" in done.stderr


@pytest.mark.parametrize(
    "prepare, error, match",
    [
        (
            lambda repo: shutil.rmtree(repo / "torchdata" / "dataloader2"),
            "NotACheckoutError",
            "is not a torchdata checkout",
        ),
        (lambda repo: shutil.rmtree(repo / ".git"), "NotACheckoutError", "is not a git checkout"),
        (
            lambda repo: (repo / "version.txt").write_text("0.6.0\n"),
            "UnsupportedVersionError",
            "0.6.0 is not supported",
        ),
        (
            lambda repo: (repo / "torchdata" / "__init__.py").write_text("# edited\n"),
            "DirtyCheckoutError",
            "is not clean",
        ),
        (
            lambda repo: git(repo, "branch", "mprs-snapshot"),
            "DirtyCheckoutError",
            "already has a branch 'mprs-snapshot'",
        ),
    ],
    ids=["not-torchdata", "not-git", "version", "dirty", "branch-exists"],
)
def test_refusals_are_typed_and_change_nothing(
    checkout: Path, prepare: object, error: str, match: str
) -> None:
    """(Refused before the linters are needed: a run without their environment refuses the same.)"""
    prepare(checkout)  # type: ignore[operator]
    if (checkout / "version.txt").read_text().startswith("0.6.0"):
        git(checkout, "commit", "-q", "-am", "another version")
    before = state(checkout) if (checkout / ".git").exists() else None
    with pytest.raises(getattr(tool("errors"), error), match=match):
        tool("series").export(checkout, tools=TOOLS_BIN)
    if before is not None:
        assert state(checkout) == before


@pytest.mark.upstream_series  # (it makes commits: it needs the linters' environment)
def test_a_failure_half_way_puts_the_checkout_back(checkout: Path, tools_bin: Path) -> None:
    # A file the third commit adds exists already: two commits are made, then the export fails.
    (checkout / "torchdata" / "dataloader2" / "communication" / "channel.py").write_text("# upstream's own\n")
    git(checkout, "add", "-A")
    git(checkout, "commit", "-q", "-m", "a channel.py of upstream's")
    before = state(checkout)
    with pytest.raises(tool("errors").UpstreamLayoutError, match="communication/channel.py exists already"):
        tool("series").export(checkout, tools=tools_bin)
    assert state(checkout) == before, "no branch left behind, same HEAD, clean tree"


def test_without_the_formatters_nothing_changes(checkout: Path, tmp_path: Path) -> None:
    before = state(checkout)
    with pytest.raises(tool("errors").ToolMissingError, match="requirements-upstream-lint.txt"):
        tool("series").export(checkout, tools=tmp_path)
    assert state(checkout) == before


@pytest.mark.upstream_series  # (it makes commits: it needs the linters' environment)
def test_a_commit_deletes_what_the_series_replaces_and_edits_each_place_it_names(
    checkout: Path, tools_bin: Path
) -> None:
    series, errors = tool("series"), tool("errors")
    writer = series.SeriesWriter(checkout, tool("manifest").load(), tools_bin)
    assert writer.delete("torchdata/dataloader2/communication/queue.py") == (
        "torchdata/dataloader2/communication/queue.py"
    )
    assert not (checkout / "torchdata/dataloader2/communication/queue.py").exists()
    with pytest.raises(errors.UpstreamLayoutError, match="queue.py does not exist in this checkout"):
        writer.delete("torchdata/dataloader2/communication/queue.py")
    prefetcher = "torchdata/datapipes/iter/util/prefetcher.py"
    old = "communication.iter.TerminateRequired"
    assert (checkout / prefetcher).read_text().count(old) == 2
    with pytest.raises(errors.UpstreamLayoutError, match="TerminateRequired' exactly 1 time"):
        writer.edit(prefetcher, old, "X")
    writer.edit(prefetcher, old, "X", count=2)
    assert old not in (checkout / prefetcher).read_text()
    writer.commit(["torchdata/dataloader2/communication/queue.py", prefetcher], "t", "b")
    assert git(checkout, "status", "--porcelain") == "", "the deletion is committed too"
    assert "D\ttorchdata/dataloader2/communication/queue.py" in git(
        checkout, "show", "--name-status", "--format=", "HEAD"
    )


def test_a_commit_that_only_deletes_code_needs_no_test_of_its_own(tmp_path: Path) -> None:
    check = tool("check")
    env = {**os.environ, **IDENTITY}
    (tmp_path / "torchdata").mkdir()
    steps = [
        {
            "torchdata/a.py": "A = 1\n",
            "torchdata/b.py": "B = 2\n",
            "torchdata/__init__.py": "from . import a, b\n",
        },
        {"torchdata/b.py": None, "torchdata/__init__.py": "from . import a\n"},  # a deletion
        {"torchdata/a.py": "A = 3\n"},  # a change
    ]
    for files in steps:
        for name, text in files.items():
            if text is None:
                (tmp_path / name).unlink()
            else:
                (tmp_path / name).write_text(text)
        for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "step"]):
            subprocess.run(["git", *command], cwd=tmp_path, check=True, env=env, capture_output=True)
    deletion, change = git(tmp_path, "rev-list", "--reverse", "HEAD").split()[1:]
    assert check.only_deletes(tmp_path, deletion) and not check.only_deletes(tmp_path, change)
    report = check.Report()
    check.check_shape(tmp_path, git(tmp_path, "rev-list", "--max-parents=0", "HEAD"), "HEAD", 800, report)
    assert [p for p in report.problems if "without a test" in p] == [
        "step: changes torchdata/ without a test"
    ]


def test_a_docstring_names_what_a_later_pull_request_adds_as_a_literal(tmp_path: Path) -> None:
    """A reference resolves at every commit: to a module not written yet it becomes a literal, to
    a public name not exported yet it names the name's module, to upstream's it stays."""
    loaded = MANIFEST
    init = tmp_path / "torchdata/dataloader2/__init__.py"
    init.parent.mkdir(parents=True)
    init.write_text('__all__ = [\n    "DataLoader2",\n    "MultiProcessingReadingService",\n]\n')
    writer = tool("series").SeriesWriter(tmp_path, loaded, tmp_path)
    for commit in loaded.commits[:3]:  # to the messages' commit: the errors and the consumer come later
        writer.begin(commit)
    text = (
        "See :mod:`torchdata.dataloader2.communication.consumer`, "
        ":class:`~torchdata.dataloader2.WorkerSnapshot`, :exc:`torchdata.dataloader2.WorkerDiedError`, "
        ":class:`torchdata.dataloader2.communication.messages.GetStateRequest` and "
        ":class:`torchdata.datapipes.iter.Shuffler` for the "
        ":class:`~torchdata.dataloader2.MultiProcessingReadingService`."
    )
    assert writer.references(text) == (
        "See ``torchdata.dataloader2.communication.consumer``, "
        ":class:`~torchdata.dataloader2.worker_snapshot.WorkerSnapshot`, "
        "``torchdata.dataloader2.WorkerDiedError``, "
        ":class:`torchdata.dataloader2.communication.messages.GetStateRequest` and "
        ":class:`torchdata.datapipes.iter.Shuffler` for the "
        ":class:`~torchdata.dataloader2.MultiProcessingReadingService`."
    )
    writer.written.update(m for c in loaded.commits for m in c.modules)
    writer.exported.update(tool("manifest").public_name_modules())
    assert writer.references(text) == text, "at the stack's tip every reference is there"


def test_two_modules_share_a_file_only_when_both_merge_into_it() -> None:
    manifest, errors = tool("manifest"), tool("errors")
    loaded = manifest.load()
    shared = [p for p in loaded.placements.values() if p.path.endswith("utils/worker.py")]
    assert len(shared) == 2 and all(p.merge for p in shared), "the worker loop and process_init_fn"
    unmerged = {**loaded.placements, shared[1].module: replace(shared[1], merge=False)}
    with pytest.raises(errors.ManifestError, match="same path, not both merged into it"):
        manifest.check(replace(loaded, placements=unmerged))


def test_a_module_merges_into_an_upstream_file_that_imports_nothing() -> None:
    """torchdata's error.py has no import: ours go after its license header, before its code."""
    rewrite, manifest = tool("rewrite"), tool("manifest")
    upstream = "# Copyright header.\n\n\nclass PauseIteration(StopIteration):\n    pass\n"
    ours = '"""Our errors."""\n\nimport sys\n\n\nclass Wrapper(Exception):\n    where = sys.platform\n'
    placement = manifest.Placement("_errors", "torchdata/dataloader2/error.py", merge=True)
    text = rewrite.merge(upstream, ours, placement)
    compile(text, "error.py", "exec")
    lines = text.splitlines()
    assert lines[0] == "# Copyright header." and lines.index("import sys") < lines.index(
        "class PauseIteration(StopIteration):"
    ) < lines.index("# Our errors.") < lines.index("class Wrapper(Exception):")


def test_a_merged_file_lists_upstreams_public_names_and_ours_not_our_helpers() -> None:
    """Upstream's file had no ``__all__`` (each public name was its API); ours lists its own, and
    a public helper it leaves out (the class carrying a worker's traceback) stays out."""
    rewrite, manifest = tool("rewrite"), tool("manifest")
    upstream = "import os\n\n\nclass PauseIteration(StopIteration):\n    pass\n"
    ours = (
        '__all__ = ["WorkerError"]\n\n\nclass WorkerError(RuntimeError):\n    pass\n\n\n'
        "class Carrier(Exception):\n    pass\n"
    )
    placement = manifest.Placement("_errors", "torchdata/dataloader2/error.py", merge=True)
    namespace: Dict[str, Any] = {}
    exec(rewrite.merge(upstream, ours, placement), namespace)
    assert namespace["__all__"] == ["PauseIteration", "WorkerError"] and "Carrier" in namespace


def test_test_files_are_cut_into_cumulative_slices() -> None:
    rewrite = tool("rewrite")
    source = "import os\n\n\ndef helper():\n    pass\n\n\n" + "".join(
        f"def test_{i}():\n    assert True\n\n\n" for i in range(6)
    )
    slices: List[str] = rewrite.test_slices(source, 3)
    assert len(slices) == 3 and slices[-1].rstrip() == source.rstrip()
    assert all(s.startswith("import os") for s in slices), "every slice has the header"
    counts = [s.count("def test_") for s in slices]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6


def test_a_test_class_is_cut_between_its_methods_into_cumulative_slices() -> None:
    rewrite = tool("rewrite")
    methods = "".join(f"    def test_{i}(self):\n        pass\n\n" for i in range(6))
    source = f"import os\n\n\nclass TestX(TestCase):\n{methods}\n\ninstantiate_parametrized_tests(TestX)\n"
    slices: List[str] = rewrite.test_slices(source, 3)
    for text in slices:
        compile(text, "test_x.py", "exec")
        assert text.startswith("import os"), "every slice has the header"
        assert text.rstrip().endswith("instantiate_parametrized_tests(TestX)"), "and what follows the class"
    counts = [s.count("def test_") for s in slices]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6


def test_a_test_file_can_leave_out_the_tests_a_later_commit_adds() -> None:
    rewrite = tool("rewrite")
    source = (
        "import os\n\n\ndef test_core():\n    assert True\n\n\n"
        "# Elastic resume: its own pull request.\n@decorated\ndef test_feature():\n    assert True\n\n\n"
        "def test_last():\n    assert True\n"
    )
    without = rewrite.without_tests(source, ["test_feature"])
    assert (
        without == "import os\n\n\ndef test_core():\n    assert True\n\n\ndef test_last():\n    assert True\n"
    )
    assert rewrite.without_tests(source, ["test_last"]).endswith(
        "@decorated\ndef test_feature():\n    assert True\n"
    )


def test_a_test_class_can_leave_out_the_methods_a_later_commit_adds() -> None:
    rewrite = tool("rewrite")
    source = (
        "class TestX(TestCase):\n    def test_core(self):\n        pass\n\n"
        "    # Elastic resume.\n    @parametrize('n', [1])\n    def test_feature(self, n):\n        pass\n\n"
        "    def test_last(self):\n        pass\n\n\ninstantiate_parametrized_tests(TestX)\n"
    )
    without = rewrite.without_tests(source, ["test_feature"])
    compile(without, "test_x.py", "exec")
    assert "test_feature" not in without and "Elastic" not in without and "parametrize('n'" not in without
    assert "def test_core(self)" in without and "def test_last(self)" in without


def _with_logging_tests(loaded: Any, spec: str) -> Any:
    """``loaded`` with test_logging.py exported once, as ``spec``, where it is first exported now."""
    manifest = tool("manifest")
    first = next(c for c in loaded.commits if any(t.file == "test_logging.py" for t in c.tests))

    def tests(commit: Any) -> Any:
        kept = tuple(t for t in commit.tests if t.file != "test_logging.py")
        return kept + (manifest._test_part(spec),) if commit is first else kept

    return replace(loaded, commits=tuple(replace(c, tests=tests(c)) for c in loaded.commits))


def test_the_manifest_refuses_tests_left_out_that_no_commit_adds() -> None:
    manifest, errors = tool("manifest"), tool("errors")
    loaded = manifest.load()
    left_out = _with_logging_tests(
        loaded, "test_logging.py:without=test_steady_state_iteration_logs_nothing_at_info"
    )
    with pytest.raises(errors.ManifestError, match="tests no commit adds: .*test_steady_state_iteration"):
        manifest.check(left_out)
    with pytest.raises(errors.ManifestError, match="leaves out tests it lacks: .*test_nothing_of"):
        manifest.check(_with_logging_tests(loaded, "test_logging.py:without=test_nothing_of_that_name"))


def test_each_public_name_is_exported_once_by_the_commit_of_its_module_or_a_later_one() -> None:
    manifest, errors = tool("manifest"), tool("errors")
    loaded = manifest.load()
    none = replace(loaded, commits=tuple(replace(c, exports=False) for c in loaded.commits))
    with pytest.raises(errors.ManifestError, match="public names no commit exports: .*WorkerSnapshot"):
        manifest.check(none)
    again = replace(loaded, commits=(*loaded.commits[:-1], replace(loaded.commits[-1], exports=True)))
    with pytest.raises(errors.ManifestError, match="exports no name that is not exported already"):
        manifest.check(again)


UPSTREAM_FILE = '''import os

from torchdata.dataloader2 import communication

__all__ = ["Loop", "Server"]


class Server:
    """Upstream's server."""

    name = "server"

    def pause(self):
        self.paused = True
        return None


def Loop(protocol):
    while True:
        request = protocol.get()
        if isinstance(request, communication.messages.PauseRequest):
            protocol.pause()
        elif isinstance(request, communication.messages.ResumeRequest):
            protocol.resume()
        else:
            raise Exception("Unrecognized type of request received", request)
'''

FRAGMENT = '''"""Our part."""

import os
from typing import List

TARGET = "torchdata/dataloader2/communication/iter.py"
BRANCHES = (("Loop", "GetStateRequest", "protocol.answer()"),)
AT_END = (("Server.pause", "self.count += 1"),)


class Server:
    count: int = 0

    def answer(self) -> List[int]:
        return [self.count]


def Helper():
    return os.getpid()
'''


def test_a_fragment_goes_to_the_named_places_of_an_upstream_file() -> None:
    splice = tool("splice")
    assert splice.target_of(FRAGMENT) == "torchdata/dataloader2/communication/iter.py"
    text = splice.splice(UPSTREAM_FILE, FRAGMENT)
    compile(text, "iter.py", "exec")
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines.count("import os") == 1 and "from typing import List" in lines, "only missing imports"
    assert "TARGET" not in text and "BRANCHES" not in text, "the fragment's settings stay out"
    # Members join upstream's class: attributes after its docstring, methods at its end.
    assert lines.index("    count: int = 0") == lines.index('    """Upstream\'s server."""') + 1
    assert lines.index("    def answer(self) -> List[int]:") < lines.index("def Loop(protocol):")
    # The statement ends the method, before its return.
    assert lines.index("        self.count += 1") == lines.index("        return None") - 1
    # The branch goes before the loop's final else, spelled as the loop's other branches.
    branch = lines.index("        elif isinstance(request, communication.messages.GetStateRequest):")
    assert lines[branch + 1] == "            protocol.answer()" and lines[branch + 2] == "        else:"
    # Other definitions follow upstream's code under the fragment's docstring; public ones join __all__.
    assert lines.index("# Our part.") < lines.index("def Helper():")
    assert '    "Helper",' in lines


def test_a_fragment_whose_place_is_missing_is_refused() -> None:
    splice, errors = tool("splice"), tool("errors")
    for missing in ("Loop", "Server.pause"):
        upstream = UPSTREAM_FILE.replace(f"def {missing.split('.')[-1]}(", "def renamed(")
        with pytest.raises(errors.UpstreamLayoutError, match=missing):
            splice.splice(upstream, FRAGMENT)


UPSTREAM_DATAPIPE = '''from typing import Iterator, TypeVar

from torchdata.datapipes.iter import IterDataPipe

T_co = TypeVar("T_co", covariant=True)


class HeaderIterDataPipe(IterDataPipe[T_co]):
    """Upstream's header."""

    def __init__(self, source_datapipe, limit: int = 10) -> None:
        self.source_datapipe = source_datapipe
        self.limit = limit

    def __iter__(self) -> Iterator[T_co]:
        for i, value in enumerate(self.source_datapipe):
            if i < self.limit:
                yield value

    def __len__(self) -> int:
        return self.limit
'''

OUR_MODULE = '''"""Our resumable DataPipes."""

from __future__ import annotations

from typing import Any, Dict, Iterator

from torchdata.datapipes.iter import Header as HeaderIterDataPipe
from torchdata.datapipes.iter import Shuffler

from torchdata_snapshot.graph_state.resumable import Resumable

__all__ = [
    "ADAPTERS",
    "ResumableHeader",
    "ResumableShuffler",
]


class ResumableHeader(HeaderIterDataPipe, Resumable):
    """Header: its state is how many items it took."""

    STATE = {"taken": int}
    _taken = 0

    def __iter__(self) -> Iterator[Any]:
        for value in self.source_datapipe:
            self._taken += 1
            if self._taken <= self.limit:
                yield value

    def state_dict(self) -> Dict[str, Any]:
        return {"taken": self._taken}


class ResumableShuffler(Shuffler, Resumable):
    """Shuffler."""


ADAPTERS = {
    HeaderIterDataPipe: ResumableHeader,
    Shuffler: ResumableShuffler,
}
'''


def test_a_subclass_of_torchdatas_class_joins_the_class_in_place() -> None:
    """The subclass's members go into torchdata's class (a method it defines is replaced where
    it stands, under upstream's signature), its mixins come first among the class's bases, and
    the module loses the subclass, its table entry, its ``__all__`` line and the import only it used."""
    in_place, splice = tool("in_place"), tool("splice")
    spec = in_place.InPlace.parse(
        "ResumableHeader", "torchdata/datapipes/iter/util/header.py:HeaderIterDataPipe"
    )
    fragment = in_place.fragment(OUR_MODULE, spec)
    assert splice.target_of(fragment) == "torchdata/datapipes/iter/util/header.py"
    text = splice.splice(UPSTREAM_DATAPIPE, fragment)
    compile(text, "header.py", "exec")
    lines = [line.rstrip() for line in text.splitlines()]
    assert "class HeaderIterDataPipe(Resumable, IterDataPipe[T_co]):" in lines
    assert "from torchdata_snapshot.graph_state.resumable import Resumable" in lines
    assert "from typing import Any, Dict" in lines, "only the names upstream's file lacks"
    assert lines.index('    STATE = {"taken": int}') == lines.index('    """Upstream\'s header."""') + 1
    iterating = lines.index("    def __iter__(self) -> Iterator[T_co]:")
    assert lines[iterating + 1 : iterating + 3] == [
        "        for value in self.source_datapipe:",
        "            self._taken += 1",
    ]
    assert lines.count("    def __iter__(self) -> Iterator[T_co]:") == 1 and "enumerate" not in text
    assert (
        iterating
        < lines.index("    def __len__(self) -> int:")
        < lines.index("    def state_dict(self) -> Dict[str, Any]:")
    )
    assert '"""Header: its state is how many items it took."""' not in text, (
        "the class keeps its own docstring"
    )

    rest = in_place.without(OUR_MODULE, ["ResumableHeader"])
    compile(rest, "resumable_datapipes.py", "exec")
    assert "ResumableHeader" not in rest and "HeaderIterDataPipe" not in rest
    assert "    Shuffler: ResumableShuffler,\n" in rest and '    "ResumableShuffler",\n' in rest


def test_a_class_put_in_place_that_is_not_there_is_refused() -> None:
    in_place, errors = tool("in_place"), tool("errors")
    with pytest.raises(errors.ManifestError, match="no class ResumableCycler"):
        in_place.fragment(OUR_MODULE, in_place.InPlace.parse("ResumableCycler", "x.py:CyclerIterDataPipe"))
    with pytest.raises(errors.ManifestError, match="is not 'path/to/file.py:UpstreamClass'"):
        in_place.InPlace.parse("ResumableHeader", "header.py")


def test_the_tests_left_out_take_the_helpers_tables_and_imports_only_they_used() -> None:
    """A commit that leaves tests out carries only the header its tests need: a helper, a table
    and the entries set in it, and an import that only the left-out tests used, go with them; what
    a kept test uses, and an import nothing used before either (a side effect), stay."""
    rewrite = tool("rewrite")
    source = (
        "import json\nimport os\nimport side_effect  # noqa: F401\n\nfrom readers import Reader\n\n"
        "READERS = {}\nREADERS['csv'] = Reader\n\n\n"
        "def readers_of(kind):\n    return READERS[kind]\n\n\n"
        "def path(name):\n    return os.path.join('d', name)\n\n\n"
        "def test_core():\n    assert path('a')\n\n\n"
        "def test_tables():\n    assert readers_of('csv') and json.dumps(1)\n"
    )
    without = rewrite.without_tests(source, ["test_tables"])
    compile(without, "test_x.py", "exec")
    assert "def path(name)" in without and "import os" in without and "import side_effect" in without
    for gone in ("READERS", "readers_of", "import json", "from readers import Reader", "test_tables"):
        assert gone not in without, gone


def test_a_commit_deletes_upstreams_definitions_once_nothing_uses_them() -> None:
    rewrite, errors = tool("rewrite"), tool("errors")
    upstream = (
        'import queue\nfrom typing import List\n\n__all__ = [\n    "New",\n    "Old",\n]\n\n\n'
        "# The queue-based one.\nclass Old:\n    q: List[int] = []\n\n"
        "    def get(self):\n        return queue.Queue()\n\n\n"
        "class New:\n    pass\n"
    )
    text = rewrite.without_definitions(upstream, ["Old"])
    compile(text, "reading_service.py", "exec")
    assert "class Old" not in text and "queue-based" not in text and "import queue" not in text
    assert "from typing import List" not in text and '    "Old",' not in text and '    "New",' in text
    assert "class New:" in text
    with pytest.raises(errors.UpstreamLayoutError, match="no top-level definition of \\['Gone'\\]"):
        rewrite.without_definitions(upstream, ["Gone"])
    used = upstream + "\n\nDEFAULT = Old\n"
    with pytest.raises(errors.UpstreamLayoutError, match="cannot be deleted: the rest of the file uses them"):
        rewrite.without_definitions(used, ["Old"])


def test_a_replaced_method_keeps_upstreams_signature_unless_ours_adds_parameters() -> None:
    """A fragment's method replaces upstream's where it stands: with upstream's signature, or
    with the fragment's when it takes more (defaulted) parameters, so both callers work."""
    upstream = (
        "class Client:\n"
        "    def get(self, key: 'Key'):\n"
        "        return self.table[key]\n\n"
        "    def drop(self):\n"
        "        self.table.clear()\n"
    )
    fragment = (
        'TARGET = "torchdata/client.py"\n\n\n'
        "class Client:\n"
        "    def get(self, key):\n"
        "        return self.table.get(key)\n\n"
        "    def drop(self, block=True):\n"
        "        self.table.clear() if block else None\n"
    )
    text = tool("splice").splice(upstream, fragment)
    compile(text, "client.py", "exec")
    assert "    def get(self, key: 'Key'):\n        return self.table.get(key)\n" in text
    assert "    def drop(self, block=True):\n        self.table.clear() if block else None\n" in text
    assert "def drop(self):" not in text


@pytest.mark.upstream_series  # (it makes commits: it needs the linters' environment)
def test_a_test_file_named_as_one_of_upstreams_is_refused_and_changes_nothing(
    checkout: Path, tools_bin: Path
) -> None:
    """torchdata's test folders are not packages: a second test_messages.py under test/ (the
    series adds one in its third commit) would break ``pytest test`` at collection."""
    (checkout / "test" / "test_messages.py").write_text("def test_upstreams_messages():\n    pass\n")
    git(checkout, "add", "-A")
    git(checkout, "commit", "-q", "-m", "a test_messages.py of upstream's")
    before = state(checkout)
    with pytest.raises(
        tool("errors").UpstreamLayoutError,
        match=r"snapshot/test_messages.py would have the name of test/test_messages.py: .*\[tests\] rename",
    ):
        tool("series").export(checkout, tools=tools_bin)
    assert state(checkout) == before


@pytest.mark.parametrize(
    "source, found",
    [
        (
            "import dataclasses\n@dataclasses.dataclass(slots=True)\nclass A:\n    x: int\n",
            ["dataclass(slots=...)"],
        ),
        (
            "from dataclasses import dataclass\n@dataclass(kw_only=True)\nclass A:\n    x: int\n",
            ["kw_only"],
        ),
        ("def f(x: int | None) -> str | None:\n    pass\n", ["annotation X | Y", "annotation X | Y"]),
        ("from __future__ import annotations\ndef f(x: int | None) -> str | None:\n    pass\n", []),
        ("import typing\nx: typing.List[int] | None = None\n", ["annotation X | Y"]),
        ("def f(x):\n    return isinstance(x, int | str)\n", ["isinstance() with X | Y"]),
        ("def f(x):\n    return isinstance(x, (int, str)) and x | 1\n", []),
        ("from typing import ParamSpec, List\n", ["typing.ParamSpec"]),
        ("pairs = list(zip([1], [2], strict=True))\n", ["zip(strict=...)"]),
    ],
)
def test_what_python39_lacks_at_run_time_is_found(source: str, found: List[str]) -> None:
    problems = tool("py39").runtime_problems(source, "m.py")
    assert len(problems) == len(found), problems
    for problem, what in zip(problems, found):
        assert problem.startswith("m.py:") and what in problem, problem


def test_what_python39_cannot_parse_is_found(tmp_path: Path) -> None:
    bad, good = tmp_path / "bad.py", tmp_path / "good.py"
    bad.write_text("def f(x):\n    match x:\n        case 1:\n            pass\n")
    good.write_text("def f(x):\n    return x\n")
    assert [p.split(":")[0] for p in tool("py39").syntax_problems([bad, good])] == [str(bad)]
