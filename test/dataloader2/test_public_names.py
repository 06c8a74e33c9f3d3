"""The reading service's snapshot type, options, errors and functions are importable from the
package DataLoader2 users import, listed in its ``__all__``, and documented (elastic resume's own
names: test_elastic.py)."""

import pytest

import torchdata_snapshot as package

PUBLIC_NAMES = [
    "BatchingOptions",
    "ChangedFileError",
    "CheckpointError",
    "IncompatibleCheckpointError",
    "InvalidCheckpointError",
    "MultiProcessingReadingService",
    "ReadingServiceClosedError",
    "ReadingServiceError",
    "ReplayDivergenceError",
    "StateCaptureError",
    "StateRestoreError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerSnapshot",
    "WorkerTimeoutError",
    "load_state_dict",
    "register_state_functions",
]


def test_all_stays_sorted() -> None:
    assert package.__all__ == sorted(package.__all__)


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_is_exported_and_documented(name: str) -> None:
    assert name in package.__all__
    doc = getattr(package, name).__doc__
    assert doc and doc.strip(), f"{name} has no docstring"
