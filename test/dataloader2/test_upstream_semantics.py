"""What upstream's own DataLoader2 tests expect of a MultiProcessingReadingService, in our words
(docs/migration.rst): the graph the reading service adapted, restarting a saved epoch from its
beginning, seeds that depend only on the SeedGenerator handed over, and breaking out early."""

from __future__ import annotations

import random
from typing import Any

import numpy
import pytest
import torch
from pipelines import NonReplicable, rs
from torchdata.datapipes.iter import IterableWrapper


def reseed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


# --- the adapted graph --------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_end_datapipe_is_the_last_datapipe_of_the_adapted_graph(make_dl: Any, num_workers: int) -> None:
    dl = make_dl(NonReplicable(IterableWrapper(range(10)).sharding_filter()), rs(num_workers))
    it = iter(dl)
    assert type(dl.reading_service._end_datapipe) is NonReplicable, "what upstream puts there"
    assert sorted(list(it) + list(dl)) == sorted(2 * list(range(10)))
