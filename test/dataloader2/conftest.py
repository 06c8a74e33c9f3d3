"""Shared fixtures: DataLoader2s that are always shut down, so no worker outlives its test."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, List

import pytest
from torchdata.dataloader2 import DataLoader2

sys.path.insert(0, str(Path(__file__).parent))  # `import pipelines` in tests and in spawned workers


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mp-context",
        default=None,
        choices=["fork", "spawn", "forkserver"],
        help="start method of the tests that do not choose one (default: fork)",
    )
    parser.addoption(
        "--full-matrix",
        action="store_true",
        default=False,
        help="run the exact-resume contract over every combination of its matrix (slow)",
    )


def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import settings

    # Every example starts processes: no per-example deadline; more examples for the full matrix.
    settings.register_profile("suite", max_examples=20, deadline=None)
    settings.register_profile("full-matrix", max_examples=150, deadline=None)
    settings.load_profile("full-matrix" if config.getoption("--full-matrix") else "suite")
    context = config.getoption("--mp-context")
    if context is not None:
        # An environment variable, so that fresh processes started by tests see it too.
        os.environ["TORCHDATA_SNAPSHOT_TEST_CONTEXT"] = context
        import pipelines

        pipelines.CONTEXT = context


@pytest.fixture
def make_dl() -> Any:
    """``make_dl(datapipe, reading_service, seed=0)``: a seeded DataLoader2, shut down after the test."""
    created: List[DataLoader2] = []

    def make(datapipe: Any, reading_service: Any, seed: Any = 0) -> DataLoader2:
        dl = DataLoader2(datapipe, reading_service=reading_service)
        if seed is not None:
            dl.seed(seed)
        created.append(dl)
        return dl

    yield make
    for dl in created:
        dl.shutdown()


Maker = Callable[..., DataLoader2]
