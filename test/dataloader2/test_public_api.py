"""The public API changes only on purpose: this list is the contract of `import torchdata_snapshot`."""

import torchdata_snapshot

EXPECTED_PUBLIC_NAMES = [
    "BatchingOptions",
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
    "gather_elastic_state",
    "register_elastic",
    "register_state_functions",
]


def test_all_is_exactly_the_public_api() -> None:
    # Sorted, exported and documented: test_public_names.py; ProtocolError is public here only.
    assert torchdata_snapshot.__all__ == EXPECTED_PUBLIC_NAMES


def test_the_package_says_it_is_typed() -> None:
    from importlib import resources

    assert resources.files("torchdata_snapshot").joinpath("py.typed").is_file()
