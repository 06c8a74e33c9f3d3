"""The exception hierarchy: users catch "a process failed" apart from "the checkpoint does not fit"."""

import pickle
import sys
import unittest
from unittest import TestCase

import pytest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.utils.data._utils.worker import ExceptionWrapper  # what carries a worker's error

from torchdata_snapshot import _errors as errors

#: The reading service's exceptions: the classes the module exports. In torchdata's tree their
#: module (dataloader2/error.py) also holds torchdata's PauseIteration, a StopIteration that
#: signals a pause, not an error, and lists it with these.
ERRORS = [
    name
    for name in errors.__all__
    if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), BaseException)
    if name != "PauseIteration"
]


class TestErrors(TestCase):
    def test_every_error_is_a_reading_service_error_and_a_runtime_error(self) -> None:
        for name in ERRORS:
            cls = getattr(errors, name)
            assert issubclass(cls, errors.ReadingServiceError), name
            assert issubclass(cls, RuntimeError), name

    @parametrize(
        "cls, family",
        [
            (errors.WorkerDiedError, errors.WorkerError),
            (errors.WorkerTimeoutError, errors.WorkerError),
            (errors.StateCaptureError, errors.CheckpointError),
            (errors.StateRestoreError, errors.CheckpointError),
            (errors.InvalidCheckpointError, errors.CheckpointError),
            (errors.IncompatibleCheckpointError, errors.CheckpointError),
            (errors.ReplayDivergenceError, errors.CheckpointError),
        ],
    )
    def test_families(self, cls: type, family: type) -> None:
        assert issubclass(cls, family)
        other = errors.CheckpointError if family is errors.WorkerError else errors.WorkerError
        assert not issubclass(cls, other), "a process failure and a misfit checkpoint must be told apart"

    def test_bad_checkpoint_input_is_also_a_value_error(self) -> None:
        assert issubclass(errors.InvalidCheckpointError, ValueError)
        assert issubclass(errors.IncompatibleCheckpointError, ValueError)

    def test_errors_survive_pickling_with_their_message(self) -> None:
        # Errors raised in a worker travel to the main process as pickled values.
        for name in ERRORS:
            err = getattr(errors, name)("worker 2 (pid 7) exited")
            again = pickle.loads(pickle.dumps(err))
            assert type(again) is type(err) and str(again) == str(err)
            assert str(again).startswith("worker 2 (pid 7) exited (troubleshooting: ")

    @parametrize("name", ERRORS)
    def test_every_message_names_the_troubleshooting_entry_of_its_class_once(self, name: str) -> None:
        cls = getattr(errors, name)
        entry = f"docs/troubleshooting.rst#{name.lower()}"
        assert str(cls("a cause")) == f"a cause (troubleshooting: {entry})"
        # A message that quotes another error of its class (a worker that died again) names it once.
        assert str(cls(f"{cls('a cause')} (and again)")).count(entry) == 1
        # Raised in a worker, re-raised in the main process with the worker's traceback: once.
        try:
            raise cls("a cause")
        except cls:
            wrapper = ExceptionWrapper(sys.exc_info(), where="in worker process 0")
        with pytest.raises(cls) as raised:
            wrapper.reraise()
        assert str(raised.value).count(entry) == 1


instantiate_parametrized_tests(TestErrors)


if __name__ == "__main__":
    unittest.main()
