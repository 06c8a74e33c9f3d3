"""The suite's own options work the way CI passes them: without a path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("option", [["--mp-context", "spawn"], ["--full-matrix"], ["--tensor-pool"]])
def test_options_are_accepted_without_a_path(option: list) -> None:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *option]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "tests collected" in run.stdout


def test_mp_context_reaches_the_pipelines_of_the_tests() -> None:
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--mp-context", "forkserver",
        "test/dataloader2/test_suite_options.py::test_the_context_seen_by_tests",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.parametrize("option", ["--tensor-pool", "--no-tensor-pool"])
def test_tensor_pool_reaches_the_reading_services_of_the_tests(option: str) -> None:
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", option,
        "test/dataloader2/test_suite_options.py::test_the_tensor_pool_seen_by_tests",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_the_tensor_pool_seen_by_tests(request: pytest.FixtureRequest) -> None:
    import pipelines
    from contract import Config

    # Neither option: the reading service's default (on where the platform has it).
    chosen = True if request.config.getoption("--tensor-pool") else None
    chosen = False if request.config.getoption("--no-tensor-pool") else chosen
    assert pipelines.rs(1).tensor_pool is chosen
    assert Config("tiny", 1).reading_service().tensor_pool is chosen


def test_the_context_seen_by_tests(request: pytest.FixtureRequest) -> None:
    import pipelines

    chosen, used = request.config.getoption("--mp-context") or "fork", pipelines.CONTEXT
    assert used == chosen


def test_a_start_method_the_platform_lacks_is_skipped_saying_why(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on Windows (spawn only): the suite's conftest skips what it cannot start.
    conftest = next(
        plugin
        for plugin in request.config.pluginmanager.get_plugins()
        if getattr(plugin, "__file__", "") == str(Path(__file__).with_name("conftest.py"))
    )
    monkeypatch.setattr(conftest, "START_METHODS", ["spawn"])

    class Item:
        def __init__(self, context: object) -> None:
            self.callspec = type("CallSpec", (), {"params": {"context": context}})()
            self.markers: list = []

        def add_marker(self, marker: object) -> None:
            self.markers.append(marker)

    fork, spawn, other = Item("fork"), Item("spawn"), Item(3)
    conftest.pytest_collection_modifyitems([fork, spawn, other])
    assert [m.kwargs["reason"] for m in fork.markers] == [f"no 'fork' start method on {sys.platform}"]
    assert spawn.markers == [] and other.markers == []


def test_the_leak_guard_counts_no_tensor_pools_where_there_is_no_proc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """macOS and Windows have no /proc (and no memfd, so no pool): the autouse guard must not fail
    every test there by reading /proc/self/maps."""
    import builtins

    import conftest

    real_open = builtins.open

    def without_proc(path: object, *args: object, **kwargs: object) -> object:
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", without_proc)
    assert conftest._mapped_pools() == 0
