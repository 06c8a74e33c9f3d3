"""torchdata_snapshot: a checkpointable, fast ``MultiProcessingReadingService`` for DataLoader2."""

from torchdata_snapshot.errors import (
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

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "IncompatibleCheckpointError",
    "InvalidCheckpointError",
    "ProtocolError",
    "ReadingServiceClosedError",
    "ReadingServiceError",
    "ReplayDivergenceError",
    "StateCaptureError",
    "StateRestoreError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerTimeoutError",
]
