"""Command-line options of the suite. They live here, at the root of ``testpaths``, because pytest
reads ``pytest_addoption`` only from the conftest files it loads at start-up: declared deeper,
``scripts/test.sh --mp-context spawn`` (no path given) would be refused as an unknown option."""

from __future__ import annotations

import multiprocessing
import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mp-context",
        default=None,
        choices=["fork", "spawn", "forkserver"],
        help="start method of the tests that do not choose one (default: fork)",
    )
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=40,
        help="how many damaged checkpoints the fuzz test tries (CI's workflow: 10000)",
    )
    parser.addoption(
        "--tensor-pool",
        action="store_true",
        default=False,
        help="the reading services of the tests that do not choose ask for tensor_pool=True",
    )
    parser.addoption(
        "--no-tensor-pool",
        action="store_true",
        default=False,
        help="the reading services of the tests that do not choose turn the tensor pool off "
        "(tensor_pool=False; by default they have it where the platform does)",
    )
    parser.addoption(
        "--full-matrix",
        action="store_true",
        default=False,
        help="run the exact-resume contract over every combination of its matrix (slow)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Read by test_checkpoint_fuzz.py and helpers/draws.py when they are imported (the counts of
    # examples are set then).
    os.environ["TORCHDATA_SNAPSHOT_FUZZ_EXAMPLES"] = str(config.getoption("--fuzz-examples"))
    if config.getoption("--full-matrix"):
        os.environ["TORCHDATA_SNAPSHOT_PROPERTY_EXAMPLES"] = "150"
        os.environ["TORCHDATA_SNAPSHOT_FULL_MATRIX"] = "1"  # read by helpers/contract.py
    if config.getoption("--tensor-pool") and config.getoption("--no-tensor-pool"):
        raise pytest.UsageError("--tensor-pool and --no-tensor-pool contradict each other")
    if config.getoption("--tensor-pool") or config.getoption("--no-tensor-pool"):
        # Read by pipelines.py and contract.py, in this process and the fresh ones tests start.
        os.environ["TORCHDATA_SNAPSHOT_TEST_TENSOR_POOL"] = "1" if config.getoption("--tensor-pool") else "0"
    context = config.getoption("--mp-context")
    if context is not None:
        # An environment variable, read by test/dataloader2/helpers/pipelines.py when it is imported
        # (after this hook), so that fresh processes started by tests see it too.
        os.environ["TORCHDATA_SNAPSHOT_TEST_CONTEXT"] = context
    if (context or "fork") == "forkserver":
        # As docs/reliability.rst advises: workers start without importing torch again.
        multiprocessing.set_forkserver_preload(["torch", "torchdata.datapipes", "torchdata_snapshot"])
