"""The fields of a ``DataLoader2`` that a restore with the user's own pipeline sets
(``load_state_dict(dataloader, state)``), and the reading service's part of its state."""

from __future__ import annotations

import pickle
from typing import Any, Dict

from torchdata.dataloader2.dataloader2 import RANDOMNESS_STATE_KEY_NAME, READING_SERVICE_STATE_KEY_NAME


def dataloader2_started(dataloader: Any) -> bool:
    """Whether ``dataloader`` was iterated (its reading service initialized) or shut down: a state
    loaded then would never reach its reading service."""
    return bool(dataloader._adapted or dataloader._datapipe_iter is not None or dataloader._terminated)


def dataloader2_reading_service_state(state: Any) -> Any:
    """The reading service's part of a ``DataLoader2.state_dict()``; ``KeyError`` if it has none."""
    return state[READING_SERVICE_STATE_KEY_NAME]


def load_dataloader2_state(dataloader: Any, reading_service_state: Any, state: Dict[str, Any]) -> None:
    """What ``DataLoader2.load_state_dict(state)`` does, but for the pipeline: ``dataloader``'s
    first ``iter()`` restores ``reading_service_state`` into its reading service, with the seeds
    ``state`` recorded (when it has them: torchdata >= 0.7), and ``state_dict()`` returns ``state``
    until then (torchdata >= 0.8 caches it). The pipeline ``state`` pickled is not read."""
    dataloader.reading_service_state = reading_service_state
    randomness = state.get(RANDOMNESS_STATE_KEY_NAME)
    if randomness is not None:
        dataloader._seed, dataloader._reset_seed = randomness[0], randomness[1]
        dataloader._seed_generator = pickle.loads(randomness[2])
        dataloader._initial_seed_generator = pickle.loads(randomness[3])
    if hasattr(dataloader, "_state_dict"):
        dataloader._state_dict = state
