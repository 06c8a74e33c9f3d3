"""Property: for any pipeline shape, configuration and position, a fresh process resumes exactly.

Hypothesis draws the configuration and the position ``k`` (20 examples by default, 150 with
``--full-matrix``: the profiles are loaded in conftest.py); each example is checked by the same
helper as the contract matrix.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from contract import Config, Resumer, check_contract, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipelines import ELASTIC_DECLARED, PIPELINES, REPLAYED_ONLY

#: The shapes any build of the reading service runs; those only elastic resume can build are
#: test_elastic.py's (the same contract, over its matrix).
SHAPES = sorted(set(PIPELINES) - ELASTIC_DECLARED)


@pytest.fixture(scope="module")
def resumer() -> Iterator[Resumer]:
    r = Resumer()
    yield r
    r.close()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    shape=st.sampled_from(SHAPES),
    num_workers=st.sampled_from([0, 1, 2, 4]),
    worker_prefetch_cnt=st.sampled_from([0, 1, 10]),
    main_prefetch_cnt=st.sampled_from([0, 1, 10]),
    n=st.integers(min_value=0, max_value=50),
    epoch=st.integers(min_value=0, max_value=1),
    data=st.data(),
)
def test_any_configuration_resumes_exactly_at_any_position(
    resumer: Resumer,
    shape: str,
    num_workers: int,
    worker_prefetch_cnt: int,
    main_prefetch_cnt: int,
    n: int,
    epoch: int,
    data: st.DataObject,
) -> None:
    config = Config(shape, num_workers, worker_prefetch_cnt, main_prefetch_cnt, n=n, epoch=epoch)
    length = len(reference(config, epoch + 3)[epoch])
    k = data.draw(st.integers(min_value=0, max_value=length), label="k")
    check_contract(resumer, config, [k])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    shape=st.sampled_from([shape for shape in SHAPES if shape not in REPLAYED_ONLY]),
    num_workers=st.sampled_from([1, 2, 4]),
    prefetch=st.sampled_from([0, 1, 10]),
    interval=st.integers(min_value=1, max_value=8),
    n=st.integers(min_value=0, max_value=60),
    data=st.data(),
)
def test_restoring_from_states_gives_what_replay_gives(
    resumer: Resumer, shape: str, num_workers: int, prefetch: int, interval: int, n: int, data: st.DataObject
) -> None:
    # check_contract compares with the uninterrupted run, which is also what replay restores.
    options = (("stateful", True), ("max_items_between_captures", interval))
    config = Config(shape, num_workers, prefetch, prefetch, n=n, rs_options=options)
    length = len(reference(config, 4)[1])
    check_contract(resumer, config, [data.draw(st.integers(min_value=0, max_value=length), label="k")])
