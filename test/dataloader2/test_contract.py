"""The exact-resume contract (docs/contract.rst) over its parameter matrix; every resume in a fresh
process.

The default run covers the matrix with ``fork`` and the diagonal of the prefetch counts, plus a
representative slice with ``spawn`` and ``forkserver``; ``--full-matrix`` runs every
combination (CI's workflow does).
"""

from __future__ import annotations

import itertools
import unittest
from typing import Any, List

from conftest import start_methods
from contract import (
    AFTER_END,
    FULL_MATRIX,
    POSITIONS,
    PREFETCH,
    WORKERS,
    Config,
    ResumeTask,
    case_name,
    check_contract,
    encode_state,
    matrix,
    resolve_positions,
    take_states,
)
from pipelines import ELASTIC_DECLARED, PIPELINES, REPLAYED_ONLY
from suite_case import ResumingTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

SHAPES = sorted(set(PIPELINES) - ELASTIC_DECLARED)


SLICE = [
    Config("shuffle_after_sharding", 2, 1, 10),
    Config("global_rng", 2, 10, 0),
    Config("dispatch", 2, 0, 1),
]

RESUMABLE_SHAPES = [shape for shape in SHAPES if shape not in REPLAYED_ONLY]

STATEFUL = (("stateful", True), ("max_items_between_captures", 3))


def stateful_matrix(full: bool) -> List[Any]:
    workers = WORKERS[1:]  # in-process pipelines replay in the main process
    prefetches = list(itertools.product(PREFETCH, PREFETCH)) if full else [(0, 0), (10, 10)]
    return [
        Config(shape, w, wp, mp, rs_options=STATEFUL)
        for shape, w, (wp, mp) in itertools.product(RESUMABLE_SHAPES, workers, prefetches)
    ]


class TestContract(ResumingTestCase):
    @parametrize("matrix_config", matrix(SHAPES, FULL_MATRIX), name_fn=case_name)
    def test_exact_resume_over_the_matrix(self, matrix_config: Config) -> None:
        check_contract(self.resumer, matrix_config, resolve_positions(matrix_config, POSITIONS))

    @parametrize("context", start_methods("spawn", "forkserver"))
    @parametrize("config", SLICE, name_fn=case_name)
    def test_exact_resume_with_other_start_methods(self, config: Config, context: str) -> None:
        config = Config(**{**config.__dict__, "context": context})
        positions = POSITIONS if FULL_MATRIX else ["middle"]
        check_contract(self.resumer, config, resolve_positions(config, positions))

    @parametrize("context", start_methods("fork", "spawn", "forkserver"))
    @parametrize("via", ["from_state", "load_state_dict"])
    def test_cycle_after_sharding_resumes_exactly_from_captured_states(self, via: str, context: str) -> None:
        """The second pass of cycle() iterates the sharding filter afresh, not from the loaded state."""
        config = Config(
            "sharding_under_cycle", 3, context=context, rs_options=(("max_items_between_captures", 3),)
        )
        check_contract(self.resumer, config, resolve_positions(config, ["one", "middle"]), via=via)

    @parametrize("through", ["torch", "pickle"])
    @parametrize("via", ["from_state", "load_state_dict"])
    def test_every_way_to_save_and_load(self, through: str, via: str) -> None:
        config = Config("global_rng", 2)
        check_contract(
            self.resumer, config, resolve_positions(config, ["one", "middle"]), through=through, via=via
        )

    def test_several_checkpoints_in_one_epoch(self) -> None:
        config = Config("shuffle_after_sharding", 4, n=60)
        check_contract(self.resumer, config, [3, 4, 17, 30, 31, 59])

    @parametrize("epoch", [0, 2])
    def test_checkpoints_in_the_first_and_a_later_epoch(self, epoch: int) -> None:
        config = Config("batch", 2, epoch=epoch)
        check_contract(self.resumer, config, resolve_positions(config, ["one", "middle"]))

    def test_without_a_seed_the_resumed_epoch_still_continues_exactly(self) -> None:
        config = Config("global_rng", 2, seed=None)
        check_contract(self.resumer, config, resolve_positions(config, ["middle"]))

    def test_more_workers_than_items(self) -> None:
        config = Config("shuffle_before_sharding", 4, n=3)
        check_contract(self.resumer, config, [0, 1, 2, 3, AFTER_END])

    @parametrize(
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
        name_fn=case_name,
    )
    def test_a_checkpoint_of_a_restored_run_three_times_over(self, config: Config) -> None:
        run, [(k, state)] = take_states(config, [5])
        expected = run[config.epoch][k:] + run[config.epoch + 1]
        got: List[Any] = []
        data = encode_state(state, "torch")
        for step in (4, 7, 3):
            result = self.resumer.run(ResumeTask(config, data, through="torch", take=step))
            got += result["taken"]
            data = result["state"]
        final = self.resumer.run(ResumeTask(config, data, through="torch"))
        got += final["epochs"][0] + final["epochs"][1]
        assert got == expected

    @parametrize("prefetch", [(0, 0), (10, 1), (1, 10)])
    def test_prefetch_counts_may_change_on_restore(self, prefetch: Any) -> None:
        config = Config("global_rng", 2, 10, 10)
        run, states = take_states(config, [7])
        ((k, state),) = states
        result = self.resumer.run(ResumeTask(config, encode_state(state, "pickle"), prefetch=prefetch))
        assert result["epochs"] == [run[config.epoch][k:], run[config.epoch + 1]]

    @parametrize("positions", [["one", "middle", "last", "after_end"]])
    @parametrize(
        "stateful_config", stateful_matrix(FULL_MATRIX), name_fn=lambda c: f"{case_name(c)}_stateful"
    )
    def test_exact_resume_from_captured_states(self, stateful_config: Config, positions: Any) -> None:
        check_contract(self.resumer, stateful_config, resolve_positions(stateful_config, positions))


instantiate_parametrized_tests(TestContract)


if __name__ == "__main__":
    unittest.main()
