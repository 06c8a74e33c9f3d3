"""Request and response messages between the main process, the workers and the dispatcher.

They sit beside upstream's ``torchdata.dataloader2.communication.messages`` (and subclass its
``Request``/``Response`` roots, so ``isinstance`` checks written against upstream still hold),
with the requests the RFC asked for (``GetStateRequest``/``GetStateResponse``) and what streaming
and restore need. Every message is a small frozen dataclass.

See ``NOTE [ Snapshot protocol ]`` in :mod:`torchdata_snapshot._worker` for who sends what, when.

Data moves in batches: a ``GetNextRequest(count=n)`` grants the receiver the right to send ``n``
more items, and items come back as ``ItemsResponse`` batches, each item pickled on its own so
that a batch can be bounded by bytes as well as by count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from torchdata_snapshot._compat import ExceptionWrapper
from torchdata_snapshot._compat import upstream_messages as upstream

__all__ = [
    "ErrorResponse",
    "GetNextRequest",
    "GetStateRequest",
    "GetStateResponse",
    "ItemsResponse",
    "LimitRequest",
    "LimitResponse",
    "PauseRequest",
    "PauseResponse",
    "ReplayProgressResponse",
    "ReplayRequest",
    "ReplayResponse",
    "Request",
    "ResetEpochRequest",
    "ResetEpochResponse",
    "Response",
    "ResumeRequest",
    "ResumeResponse",
    "StateMarkResponse",
    "StopIterationResponse",
    "TerminateRequest",
    "TerminateResponse",
    "WorkerExceptionResponse",
]


class Request(upstream.Request):
    """Root of the requests of this protocol."""


class Response(upstream.Response):
    """Root of the responses of this protocol."""


# --- epoch control --------------------------------------------------------------------------


@dataclass(frozen=True)
class ResetEpochRequest(Request):
    """Start epoch ``epoch``: seed the graph, reset its iterator, then wait for ``GetNextRequest``."""

    epoch: int
    seed_generator: Any
    iter_reset_fn: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class ResetEpochResponse(Response):
    """The epoch is reset; nothing of the previous epoch follows this response."""

    epoch: int


@dataclass(frozen=True)
class ReplayRequest(Request):
    """Restore by deterministic replay: produce the first ``skip`` items of the (freshly reset)
    epoch ``epoch`` and drop them; they never leave the process.

    With ``state = (position, blob)`` the graph is first loaded with the state it had after its
    ``position``-th item (stateful restore) and ``skip`` counts from there; ``state_digest`` is
    the stream's running digest at that position (see :mod:`torchdata_snapshot._digest`).
    ``digest`` is the running digest the checkpoint recorded after the last replayed item: the
    replay must end with the same one, or the reply is a ``ReplayDivergenceError``. It is a
    request of its own, sent after the dispatching process (if any) was reset too, because a
    worker's replay may need dispatched items of the new epoch.
    """

    epoch: int
    skip: int
    digest: Optional[str] = None
    state: Optional[Tuple[int, bytes]] = None
    state_digest: Optional[str] = None


@dataclass(frozen=True)
class ReplayResponse(Response):
    """``replayed`` items were produced and dropped; streaming continues after them."""

    epoch: int
    replayed: int


@dataclass(frozen=True)
class ReplayProgressResponse(Response):
    """Sent every second of a long replay, so that the main process's bounded wait for
    ``ReplayResponse`` can tell a worker that replays from one that is stuck."""

    epoch: int
    replayed: int


# --- data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GetNextRequest(Request):
    """Credit: the receiver may send ``count`` more items of epoch ``epoch``.

    Unlike upstream's one-request-one-item ``GetNextRequest``, credits accumulate; the window of
    outstanding credit is what prefetching means in this protocol.
    """

    epoch: int
    count: int = 1


@dataclass(frozen=True)
class ItemsResponse(Response):
    """``count`` items of epoch ``epoch``, in order, pickled one after the other into ``payload``
    (see :class:`~torchdata_snapshot._channel.ItemEncoder`). With replay verification on,
    ``digests`` holds the stream's running digest after each of them, as ``count`` native
    unsigned 64-bit integers (``array("Q")``; see :mod:`torchdata_snapshot._digest`)."""

    epoch: int
    count: int
    payload: bytes
    digests: Optional[bytes] = None


@dataclass(frozen=True)
class StateMarkResponse(Response):
    """The state of the worker's whole graph right after it produced its ``position``-th item of
    epoch ``epoch`` (see :mod:`torchdata_snapshot._stateful`), sent right behind that item; how
    often is paced by the worker (see ``WorkerLoop._capture_state``)."""

    epoch: int
    position: int
    state: bytes


@dataclass(frozen=True)
class StopIterationResponse(Response):
    """The graph is exhausted for epoch ``epoch``; no item follows until the next reset."""

    epoch: int


@dataclass(frozen=True)
class WorkerExceptionResponse(Response):
    """The graph of epoch ``epoch`` raised; the exception travels as a value and is re-raised where
    it is read. A reader drops it when it belongs to an older epoch, as it drops stale items;
    ``epoch=None`` (the sender is going away, whatever the epoch) is never stale."""

    epoch: Optional[int]
    exc: ExceptionWrapper


@dataclass(frozen=True)
class ErrorResponse(Response):
    """A request could not be served: unknown request type, or its handler failed.

    ``exc`` is re-raised by the receiver (a :mod:`torchdata_snapshot._errors` type, or the user's
    exception with the worker's traceback). The loop keeps serving afterwards.
    """

    request_type: str
    exc: ExceptionWrapper


# --- pause / resume / limit -----------------------------------------------------------------


@dataclass(frozen=True)
class PauseRequest(Request):
    """Stop producing after the current item; apply ``pause_fn`` to the graph (upstream semantics)."""

    pause_fn: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class PauseResponse(Response):
    """Paused. For the dispatcher, ``snapshot`` is its state at the pause point."""

    snapshot: Any = None


@dataclass(frozen=True)
class ResumeRequest(Request):
    resume_fn: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class ResumeResponse(Response):
    pass


@dataclass(frozen=True)
class LimitRequest(Request):
    """Upstream's limit: apply ``limit_fn(graph, worker_num_batches)`` inside the process."""

    num_batches: Optional[int]
    limit_fn: Optional[Callable[[Any, Optional[int]], Any]] = None
    worker_num_batches: Optional[int] = None


@dataclass(frozen=True)
class LimitResponse(Response):
    pass


# --- the RFC: state on demand ---------------------------------------------------------------


@dataclass(frozen=True)
class GetStateRequest(Request):
    """Report the process's state between two items (the loop is single-threaded, so its graph
    is paused while it answers; DataPipes with their own threads are paused around the capture).

    ``dispatcher_sent`` is set when a dispatching process was paused first: the worker reads the
    items still in flight from it (exactly that many) before answering, so the two states form
    a consistent cut.
    """

    dispatcher_sent: Optional[int] = None
    include_datapipe_states: bool = True


@dataclass(frozen=True)
class GetStateResponse(Response):
    snapshot: Any


@dataclass(frozen=True)
class TerminateRequest(Request):
    pass


@dataclass(frozen=True)
class TerminateResponse(Response):
    pass
