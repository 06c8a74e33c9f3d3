"""Shared fixtures: DataLoader2s that are always shut down, so no worker outlives its test."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, List

import pytest
from torchdata.dataloader2 import DataLoader2

sys.path.insert(0, str(Path(__file__).parent))  # `import pipelines` in tests and in spawned workers


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
