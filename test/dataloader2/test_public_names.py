"""The reading service's snapshot type, options, errors and functions are importable from the
package DataLoader2 users import, listed in its ``__all__``, and documented (elastic resume's own
names: test_elastic.py)."""

import unittest
from unittest import TestCase

from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

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
]
#: The checkpoint's, and the captured graph states': each tested below, with its own layer.
LAYER_NAMES = ["load_state_dict", "register_state_functions"]


def exported_and_documented(name: str) -> None:
    assert name in package.__all__
    doc = getattr(package, name).__doc__
    assert doc and doc.strip(), f"{name} has no docstring"


class TestPublicNames(TestCase):
    def test_all_stays_sorted(self) -> None:
        assert package.__all__ == sorted(package.__all__)

    @parametrize("name", PUBLIC_NAMES)
    def test_is_exported_and_documented(self, name: str) -> None:
        exported_and_documented(name)

    def test_load_state_dict_is_exported_and_documented(self) -> None:
        exported_and_documented("load_state_dict")

    def test_register_state_functions_is_exported_and_documented(self) -> None:
        exported_and_documented("register_state_functions")


instantiate_parametrized_tests(TestPublicNames)


if __name__ == "__main__":
    unittest.main()
