"""Property: for any pipeline shape, configuration and position, a fresh process resumes exactly.

Each test draws the configuration and the position ``k`` (20 examples by default, 150 with
``--full-matrix``: helpers/draws.py); each example is checked by the same helper as the contract
matrix.
"""

from __future__ import annotations

import unittest

from contract import Config, check_contract, reference
from draws import SeededDraw, examples
from pipelines import ELASTIC_DECLARED, PIPELINES, REPLAYED_ONLY
from suite_case import ResumingTestCase
from torch.testing._internal.common_utils import instantiate_parametrized_tests

#: The shapes any build of the reading service runs; those only elastic resume can build are
#: test_elastic.py's (the same contract, over its matrix).
SHAPES = sorted(set(PIPELINES) - ELASTIC_DECLARED)


class TestContractProperty(ResumingTestCase):
    @examples()
    def test_any_configuration_resumes_exactly_at_any_position(self, draw: SeededDraw) -> None:
        config = Config(
            draw.choice(SHAPES),
            num_workers=draw.choice([0, 1, 2, 4]),
            worker_prefetch_cnt=draw.choice([0, 1, 10]),
            main_prefetch_cnt=draw.choice([0, 1, 10]),
            n=draw.integer(0, 50),
            epoch=draw.integer(0, 1),
        )
        length = len(reference(config, config.epoch + 3)[config.epoch])
        check_contract(self.resumer, config, [draw.integer(0, length)])

    @examples()
    def test_restoring_from_states_gives_what_replay_gives(self, draw: SeededDraw) -> None:
        # check_contract compares with the uninterrupted run, which is also what replay restores.
        shape = draw.choice([shape for shape in SHAPES if shape not in REPLAYED_ONLY])
        num_workers, prefetch = draw.choice([1, 2, 4]), draw.choice([0, 1, 10])
        options = (("stateful", True), ("max_items_between_captures", draw.integer(1, 8)))
        config = Config(shape, num_workers, prefetch, prefetch, n=draw.integer(0, 60), rs_options=options)
        length = len(reference(config, 4)[1])
        check_contract(self.resumer, config, [draw.integer(0, length)])


instantiate_parametrized_tests(TestContractProperty)


if __name__ == "__main__":
    unittest.main()
