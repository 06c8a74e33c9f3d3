"""torchdata_snapshot: a checkpointable, fast ``MultiProcessingReadingService`` for DataLoader2.

Swap one import::

    from torchdata_snapshot import MultiProcessingReadingService

and every behaviour of DataLoader2's keeps working, plus :meth:`MultiProcessingReadingService.snapshot`;
:func:`load_state_dict` resumes a checkpoint with the pipeline the code builds now.

The package logs through :mod:`logging`, under the logger ``torchdata_snapshot`` (one child per
module): each restore at INFO, worker replacements and refused checkpoints at WARNING, nothing at
INFO while an epoch runs. As libraries do, it only adds a ``NullHandler``: the application
chooses where records go (``logging.basicConfig(level=logging.INFO)`` shows them).
"""

import logging

from torchdata_snapshot._errors import (
    ChangedFileError,
    CheckpointError,
    IncompatibleCheckpointError,
    InvalidCheckpointError,
    ProtocolError,
    ReadingServiceClosedError,
    ReadingServiceError,
    ReplayDivergenceError,
    StateCaptureError,
    StateRestoreError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.options import BatchingOptions
from torchdata_snapshot.core.reading_service import MultiProcessingReadingService

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "BatchingOptions",
    "ChangedFileError",
    "CheckpointError",
    "IncompatibleCheckpointError",
    "InvalidCheckpointError",
    "MultiProcessingReadingService",
    "ProtocolError",
    "ReadingServiceClosedError",
    "ReadingServiceError",
    "ReplayDivergenceError",
    "StateCaptureError",
    "StateRestoreError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerSnapshot",
    "WorkerTimeoutError",
]

# The layers above the core and the optional features plug in (see torchdata_snapshot.core.plugins):
# without a folder, the package has none of its names.


def _missing(error: ModuleNotFoundError, folder: str) -> bool:
    """Whether ``error`` is ``folder`` missing (else it is raised: a module it needs is)."""
    return error.name == f"torchdata_snapshot.{folder}"


try:
    from torchdata_snapshot.checkpoint.load_state import load_state_dict
except ModuleNotFoundError as e:
    if not _missing(e, "checkpoint"):
        raise
else:
    __all__ += ["load_state_dict"]
try:
    from torchdata_snapshot.graph_state.state_functions import register_state_functions
except ModuleNotFoundError as e:
    if not _missing(e, "graph_state"):
        raise
else:
    __all__ += ["register_state_functions"]
try:
    from torchdata_snapshot.elastic.resume import gather_elastic_state, register_elastic
except ModuleNotFoundError as e:
    if not _missing(e, "elastic"):
        raise
else:
    __all__ += ["gather_elastic_state", "register_elastic"]
__all__.sort()
