"""Messages: small frozen dataclasses beside the queue-based loop's, picklable across processes."""

import dataclasses
import inspect
import pickle
import unittest
from unittest import TestCase

import pytest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, subtest
from torchdata._utils import ExceptionWrapper
from torchdata.dataloader2.communication import messages as roots
from torchdata.dataloader2.random import SeedGenerator

from torchdata_snapshot.core import messages as m


def _wrapped_error() -> ExceptionWrapper:
    try:
        raise ValueError("boom")
    except ValueError:
        return ExceptionWrapper(where="in worker process 0")


EXAMPLES = [
    m.ResetEpochRequest(epoch=3, seed_generator=SeedGenerator(7), iter_reset_fn=None),
    m.ResetEpochRequest(
        epoch=3,
        seed_generator=SeedGenerator(7),
        iter_reset_fn=None,
        elastic=m.ElasticEpoch(
            levels=(m.Level(whole=(3, 2), partial=(0, 1)),), head_states=((1, b"\x80\x05}."),)
        ),
    ),
    m.ResetEpochResponse(epoch=3),
    m.ReplayRequest(
        epoch=3, skip=10, digest="00ff00ff00ff00ff", state=(4, b"\x80\x05}."), state_digest="0123456789abcdef"
    ),
    m.ReplayResponse(epoch=3, replayed=10),
    m.ReplayProgressResponse(epoch=3, replayed=5),
    m.GetNextRequest(epoch=3, count=16),
    m.ItemsResponse(epoch=3, count=2, payload=b"\x80\x05K\x01.\x80\x05K\x02.", digests=bytes(16)),
    m.StateMarkResponse(epoch=3, position=1024, state=b"\x80\x05}."),
    m.StopIterationResponse(epoch=3),
    m.WorkerExceptionResponse(epoch=3, exc=_wrapped_error()),
    m.ErrorResponse(request_type="FooRequest", exc=_wrapped_error()),
    m.PauseRequest(),
    m.PauseResponse(),
    m.ResumeRequest(),
    m.ResumeResponse(),
    m.LimitRequest(num_batches=4),
    m.LimitResponse(),
    m.GetStateRequest(),
    m.GetStateResponse(snapshot={"produced": 1}),
    m.TerminateRequest(),
    m.TerminateResponse(),
]


#: The messages the queue-based loop has too, with its positional arguments.
QUEUE_LOOP_ARGUMENTS = {
    "ResetEpochRequest": ("seed_generator", "iter_reset_fn"),
    "ResetEpochResponse": (),
    "LimitRequest": ("num_batches", "limit_fn", "worker_num_batches"),
    "LimitResponse": (),
    "PauseRequest": ("pause_fn",),
    "PauseResponse": (),
    "ResumeRequest": ("resume_fn",),
    "ResumeResponse": (),
    "TerminateRequest": (),
    "TerminateResponse": (),
    "GetNextRequest": (),
    "StopIterationResponse": (),
    "WorkerExceptionResponse": ("exc",),
}


#: Each example message, named by its type (and its rank among those of its type, after the first).
MESSAGE_CASES = [
    subtest(msg, name=type(msg).__name__ + (str(k) if k else ""))
    for msg, k in ((msg, [type(e) for e in EXAMPLES[:i]].count(type(msg))) for i, msg in enumerate(EXAMPLES))
]


class TestMessages(TestCase):
    def test_every_exported_message_has_an_example(self) -> None:
        # The protocol's messages are the dataclass requests and responses (the roots, and in
        # torchdata's tree the messages only the queue-based loop uses, are plain classes);
        # the other dataclasses are what messages carry.
        exported = {name for name in m.__all__ if dataclasses.is_dataclass(getattr(m, name))}
        messages = {
            name for name in exported if issubclass(getattr(m, name), (roots.Request, roots.Response))
        }
        assert messages == {type(msg).__name__ for msg in EXAMPLES}
        assert exported - messages == {"ElasticEpoch", "Level"}

    @parametrize("message", MESSAGE_CASES)
    def test_messages_are_frozen_dataclasses(self, message: object) -> None:
        assert dataclasses.is_dataclass(message)
        fields = dataclasses.fields(message)  # type: ignore[arg-type]
        if fields:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(message, fields[0].name, None)

    @parametrize("message", MESSAGE_CASES)
    def test_messages_round_trip_through_pickle(self, message: object) -> None:
        again = pickle.loads(pickle.dumps(message))
        assert type(again) is type(message)
        for f in dataclasses.fields(message):  # type: ignore[arg-type]
            if f.name not in ("exc", "seed_generator"):
                assert getattr(again, f.name) == getattr(message, f.name)

    @parametrize("message", MESSAGE_CASES)
    def test_messages_derive_from_the_message_roots(self, message: object) -> None:
        # isinstance checks written against the message roots (Request, Response) keep working.
        name = type(message).__name__
        root = roots.Request if name.endswith("Request") else roots.Response
        assert name.endswith(("Request", "Response"))
        assert isinstance(message, root)

    def test_get_next_request_is_a_credit_for_one_epoch(self) -> None:
        assert m.GetNextRequest(epoch=0).count == 1
        assert m.GetNextRequest(epoch=5, count=10) != m.GetNextRequest(epoch=6, count=10)

    def test_get_state_response_takes_the_queue_based_loops_arguments(self) -> None:
        # In torchdata's tree the snapshot RFC's pull request comes first: the queue-based loop
        # answers GetStateRequest with GetStateResponse(snapshot, dispatcher), and still does once
        # ours replaces the class.
        snapshot, dispatcher = object(), (object(),)
        response = m.GetStateResponse(snapshot, dispatcher)
        assert response.snapshot is snapshot and response.dispatcher is dispatcher
        assert m.GetStateResponse(snapshot).dispatcher == ()

    @parametrize("name", sorted(QUEUE_LOOP_ARGUMENTS))
    def test_the_table_is_the_queue_loops(self, name: str) -> None:
        # In the add-on the classes are torchdata's own; in torchdata's tree, where
        # ours replace them, the module is ours and the table is checked against ours.
        params = inspect.signature(getattr(roots, name).__init__).parameters
        positional = [
            p.name for p in params.values() if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD
        ]
        assert positional[: len(QUEUE_LOOP_ARGUMENTS[name])] == list(QUEUE_LOOP_ARGUMENTS[name])

    @parametrize("name", sorted(QUEUE_LOOP_ARGUMENTS))
    def test_a_message_the_queue_loop_also_has_takes_its_arguments_in_its_order(self, name: str) -> None:
        # The queue-based loop could build and read ours: same positional parameters, same
        # attribute names; our new fields come after, with defaults.
        values = [object() for _ in QUEUE_LOOP_ARGUMENTS[name]]
        ours = getattr(m, name)(*values)
        for param, value in zip(QUEUE_LOOP_ARGUMENTS[name], values):
            assert getattr(ours, param) is value, f"{name}.{param}"
        assert dataclasses.is_dataclass(ours)
        assert issubclass(getattr(m, name), roots.Request if name.endswith("Request") else roots.Response)


instantiate_parametrized_tests(TestMessages)


if __name__ == "__main__":
    unittest.main()
