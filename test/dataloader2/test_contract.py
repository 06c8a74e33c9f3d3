"""The exact-resume contract (docs/contract.rst) over its parameter matrix; every resume in a fresh
process.

The default run covers the matrix with ``fork`` and the diagonal of the prefetch counts, plus a
representative slice with ``spawn`` and ``forkserver``; ``--full-matrix`` runs every
combination (CI's workflow does).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, List

import pytest
from contract import (
    AFTER_END,
    POSITIONS,
    PREFETCH,
    WORKERS,
    Config,
    Resumer,
    ResumeTask,
    check_contract,
    encode_state,
    matrix,
    resolve_positions,
    take_states,
)
from pipelines import ELASTIC_DECLARED, PIPELINES, REPLAYED_ONLY

SHAPES = sorted(set(PIPELINES) - ELASTIC_DECLARED)


@pytest.fixture(scope="module")
def resumer() -> Iterator[Resumer]:
    r = Resumer()
    yield r
    r.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    full = metafunc.config.getoption("--full-matrix")
    if "matrix_config" in metafunc.fixturenames:
        metafunc.parametrize("matrix_config", matrix(SHAPES, full), ids=str)
    if "stateful_config" in metafunc.fixturenames:
        metafunc.parametrize("stateful_config", stateful_matrix(full), ids=lambda c: f"{c}-stateful")


def test_exact_resume_over_the_matrix(resumer: Resumer, matrix_config: Config) -> None:
    check_contract(resumer, matrix_config, resolve_positions(matrix_config, POSITIONS))


SLICE = [
    Config("shuffle_after_sharding", 2, 1, 10),
    Config("global_rng", 2, 10, 0),
    Config("dispatch", 2, 0, 1),
]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.parametrize("config", SLICE, ids=str)
def test_exact_resume_with_other_start_methods(
    resumer: Resumer, config: Config, context: str, request: Any
) -> None:
    config = Config(**{**config.__dict__, "context": context})
    positions = POSITIONS if request.config.getoption("--full-matrix") else ["middle"]
    check_contract(resumer, config, resolve_positions(config, positions))


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("via", ["from_state", "load_state_dict"])
def test_cycle_after_sharding_resumes_exactly_from_captured_states(
    resumer: Resumer, via: str, context: str
) -> None:
    """The second pass of cycle() iterates the sharding filter afresh, not from the loaded state."""
    config = Config(
        "sharding_under_cycle", 3, context=context, rs_options=(("max_items_between_captures", 3),)
    )
    check_contract(resumer, config, resolve_positions(config, ["one", "middle"]), via=via)


@pytest.mark.parametrize("through", ["torch", "pickle"])
@pytest.mark.parametrize("via", ["from_state", "load_state_dict"])
def test_every_way_to_save_and_load(resumer: Resumer, through: str, via: str) -> None:
    config = Config("global_rng", 2)
    check_contract(resumer, config, resolve_positions(config, ["one", "middle"]), through=through, via=via)


def test_several_checkpoints_in_one_epoch(resumer: Resumer) -> None:
    config = Config("shuffle_after_sharding", 4, n=60)
    check_contract(resumer, config, [3, 4, 17, 30, 31, 59])


@pytest.mark.parametrize("epoch", [0, 2])
def test_checkpoints_in_the_first_and_a_later_epoch(resumer: Resumer, epoch: int) -> None:
    config = Config("batch", 2, epoch=epoch)
    check_contract(resumer, config, resolve_positions(config, ["one", "middle"]))


def test_without_a_seed_the_resumed_epoch_still_continues_exactly(resumer: Resumer) -> None:
    config = Config("global_rng", 2, seed=None)
    check_contract(resumer, config, resolve_positions(config, ["middle"]))


def test_more_workers_than_items(resumer: Resumer) -> None:
    config = Config("shuffle_before_sharding", 4, n=3)
    check_contract(resumer, config, [0, 1, 2, 3, AFTER_END])


@pytest.mark.parametrize(
    "config",
    [
        Config("uneven_filter", 2, 1, 1, n=120),
        # A restore in the middle of an element: the one-to-many DataPipe finishes it before it
        # pulls from its source, and states are captured meanwhile (after every item).
        *(
            Config(shape, 2, 1, 1, rs_options=(("max_items_between_captures", 1),))
            for shape in ("unbatch", "unbatch_batch", "lines_after_sharding", "webdataset_after_sharding")
        ),
    ],
    ids=str,
)
def test_a_checkpoint_of_a_restored_run_three_times_over(resumer: Resumer, config: Config) -> None:
    run, [(k, state)] = take_states(config, [5])
    expected = run[config.epoch][k:] + run[config.epoch + 1]
    got: List[Any] = []
    data = encode_state(state, "torch")
    for step in (4, 7, 3):
        result = resumer.run(ResumeTask(config, data, through="torch", take=step))
        got += result["taken"]
        data = result["state"]
    final = resumer.run(ResumeTask(config, data, through="torch"))
    got += final["epochs"][0] + final["epochs"][1]
    assert got == expected


@pytest.mark.parametrize("prefetch", [(0, 0), (10, 1), (1, 10)])
def test_prefetch_counts_may_change_on_restore(resumer: Resumer, prefetch: Any) -> None:
    config = Config("global_rng", 2, 10, 10)
    run, states = take_states(config, [7])
    ((k, state),) = states
    result = resumer.run(ResumeTask(config, encode_state(state, "pickle"), prefetch=prefetch))
    assert result["epochs"] == [run[config.epoch][k:], run[config.epoch + 1]]


RESUMABLE_SHAPES = [shape for shape in SHAPES if shape not in REPLAYED_ONLY]
STATEFUL = (("stateful", True), ("max_items_between_captures", 3))


def stateful_matrix(full: bool) -> List[Any]:
    workers = WORKERS[1:]  # in-process pipelines replay in the main process
    prefetches = list(itertools.product(PREFETCH, PREFETCH)) if full else [(0, 0), (10, 10)]
    return [
        Config(shape, w, wp, mp, rs_options=STATEFUL)
        for shape, w, (wp, mp) in itertools.product(RESUMABLE_SHAPES, workers, prefetches)
    ]


@pytest.mark.parametrize("positions", [["one", "middle", "last", "after_end"]])
def test_exact_resume_from_captured_states(resumer: Resumer, stateful_config: Config, positions: Any) -> None:
    check_contract(resumer, stateful_config, resolve_positions(stateful_config, positions))
