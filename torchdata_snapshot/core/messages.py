"""Request and response messages between the main process, the workers and the dispatcher.

They extend the messages of the queue-based loop (``torchdata.dataloader2.communication.messages``):
they derive from its ``Request``/``Response`` roots, and a message that the queue-based loop also
has takes its arguments first, in its order, its new fields after them with defaults; so that loop
could send and read these very classes (in torchdata's tree they replace its own). With the
requests the snapshot RFC (pytorch/data#1039) asked for (``GetStateRequest``/``GetStateResponse``;
see the docs' design page) and what streaming and restore need. Every message is a small frozen dataclass.

Data moves in batches: a ``GetNextRequest(count=n)`` grants the receiver the right to send ``n``
more items, and items come back as ``ItemsResponse`` batches, each item pickled on its own so
that a batch can be bounded by bytes as well as by count.

NOTE [ Snapshot protocol ]
==========================

It governs the worker loop (:mod:`torchdata_snapshot.core.worker.loop`), the dispatching process
(:mod:`torchdata_snapshot.core.worker.dispatcher`), and in the main process the consumer, the outlet and the
checkpoint (:mod:`torchdata_snapshot.core.main.consumer`, :mod:`torchdata_snapshot.core.main.outlet`,
:mod:`torchdata_snapshot.checkpoint.format`). Words used with one meaning throughout:

=============== ==================================================================================
produced        an item came out of a worker's DataPipe graph
sent            the worker's outbox wrote it to the pipe
received        the main process read it from the pipe
handed on       the consumer gave it to the next DataPipe of the main process (the tail, if any)
delivered       it reached the user: it left the outlet, the last DataPipe of the graph
credit          how many more items a worker may send; the *window* is the credit kept per worker
snapshot        the RFC's report of one process at one consistent point (``WorkerSnapshot``)
checkpoint      the reading service's plain-data state, what ``DataLoader2.state_dict()`` stores
graph state     a worker graph's DataPipe states and global RNGs after an item, pickled; taking
                one while streaming is a *capture*
replay          producing and dropping items, to bring a fresh stream to a position
running digest  a 64-bit fold of every item of a stream so far (:mod:`torchdata_snapshot.checkpoint.digest`)
channel         the one connection between two processes: a request pipe and a response pipe
record          the main process's account of one worker's stream (``WorkerRecord``)
worker epoch    what one epoch of a worker's graph has done so far (``WorkerEpoch``, new at each reset)
tensor pool     a worker's recycled shared-memory slots for tensors (never the worker processes,
                which ``WorkerProcesses`` runs)
catalogue       what each DataPipe type of torch and torchdata is (:mod:`torchdata_snapshot.core.catalogue`)
=============== ==================================================================================

Processes and pipes
-------------------
The main process owns one :class:`~torchdata_snapshot.core.transport.channel.Channel` per worker: a request
pipe (main -> worker) and a response pipe (worker -> main). Each pipe has exactly one writer,
so the order in which a worker sends its responses is the order in which main reads them; data
and control responses share the response pipe, and a control response therefore marks an exact
position in the worker's item stream.

Streaming under credit
----------------------
The queue-based loop sends one ``GetNextRequest`` per item and waits for its answer. Here the main process
grants *credit*: ``GetNextRequest(epoch, count)`` allows the worker to send ``count`` more items.
The worker loop produces while it has credit and hands each item, pickled, to its outbox (see
:mod:`torchdata_snapshot.core.transport.outbox`): one thread that writes everything the worker
sends, in order, as ``ItemsResponse`` batches of whatever has accumulated (bounded by count and bytes, see
:class:`BatchingOptions`), so no item waits for a slow next one. The main process keeps at most
a window of ``worker_prefetch_cnt + ceil(main_prefetch_cnt / num_workers) + 1`` items
outstanding per worker (more for small items, see ``core.transport.batches.small_items_window``) and tops the
credit up when half of it was used. Items the user has not
taken yet wait in the outbox, the pipe or the main process's buffer; no thread polls anything.

Counters, per worker and epoch (always true between two messages):

* worker:  ``produced == sent + buffered`` (``buffered``: in the outbox), ``produced <= credit``;
* main:    ``received == handed_on + buffered_in_main``, and ``received <= produced``;
* after main has read a worker's ``GetStateResponse``: ``received == produced`` as of the
  answer, because the answer follows every item produced before it on the same pipe.

The order of items handed to the user never depends on timing: main takes one item from each
live worker in turn (worker 0, 1, ..., N-1, 0, ...), skipping workers whose stream has ended;
each worker's stream is a deterministic function of its graph and its seed.

Requests and their handlers (the worker loop runs the graph and serves requests in one thread,
so while it serves a request its DataPipes are paused by construction):

================== =============================================================== ===================
request            handler                                                          response
================== =============================================================== ===================
ResetEpochRequest  seed the graph (``process_reset_fn``), fresh iterator,           ResetEpochResponse
                   credit and counters to zero
ReplayRequest      load the graph state if given, produce and drop the next ``skip`` ReplayResponse
                   items (restore), check their running digest
GetNextRequest     add credit (ignored if for another epoch)                        (items, states)
PauseRequest       send what is produced, ``pause()`` DataPipes, apply ``pause_fn`` PauseResponse
ResumeRequest      apply ``resume_fn``, ``resume()`` DataPipes                      ResumeResponse
LimitRequest       apply ``limit_fn`` (DataLoader2's semantics)                          LimitResponse
GetStateRequest    pause threaded DataPipes, capture counts and states, resume     GetStateResponse
TerminateRequest   stop serving                                                     TerminateResponse
anything else      --                                                               ErrorResponse
================== =============================================================== ===================

A handler that fails answers ``ErrorResponse`` (the exception travels as a value) and the loop
keeps serving. An exception raised by the graph while producing ends the worker's stream for the
epoch with ``WorkerExceptionResponse``, after the items produced before it.

``snapshot()`` (main process): send ``GetStateRequest`` to every worker, then read each worker's
pipe up to its ``GetStateResponse``, buffering the items read on the way. No pause/resume round
trip is needed for the workers themselves. With a dispatching process: pause the workers, pause
the dispatcher and take its state, let each worker read what the dispatcher already sent, take
the workers' states, resume the dispatcher, then the workers.

Checkpoint and restore
----------------------
``checkpoint()`` needs no message at all: it records what the *user* received. The outlet (the
last DataPipe) pops, for every item it hands to the user, the worker id the consumer pushed when
it handed that item downstream; so the user's position in each worker's stream is known exactly
whatever the main-process tail buffers. Each ``ItemsResponse`` carries the worker's running
digest after each of its items (see :mod:`torchdata_snapshot.checkpoint.digest`). A stateful graph (see
:mod:`torchdata_snapshot.graph_state.graph_state`) also sends ``StateMarkResponse(position, state)`` right
behind an item, as often as ``CAPTURE_TIME_BUDGET`` of its production time allows and at most
every ``max_items_between_captures`` items. The checkpoint keeps, per worker, the running digest at the
user's position and the latest state strictly behind it (so that a restore always replays, and
checks, at least one item), the epoch's seeds and the round-robin's next worker.

``restore()`` replays from the latest state (or from the epoch's start): the epoch restarts
with the recorded seeds (``ResetEpochRequest``), the dispatcher (if any) is reset, and each
worker gets ``ReplayRequest(skip, digest, state)``: it loads the state, produces and drops the
``skip`` items after it inside its process, checks that their running digest ends as recorded,
then streams from there under credit as usual. A worker whose stream had ended ends again at
the same place, so the round-robin's order continues exactly. Main-process tails that are not
one-to-one (and ``num_workers=0``) are replayed by the outlet itself.

Liveness and shutdown
---------------------
Every blocking wait has a timeout (``LIVENESS_CHECK_INTERVAL_S``) after which the waiter checks
the other side: the main process checks the worker's exit code (and raises naming worker id, pid
and exit code), a worker checks that the training process still exists (its parent, or under
``forkserver`` the sentinel multiprocessing hands it; see ``ParentWatch``). The main process
closes its copies of the workers' pipe ends, so a dead worker is also seen at once as
end-of-file. Shutdown sends ``TerminateRequest``, reads until ``TerminateResponse`` (bounded),
joins with a timeout and kills what is left; it is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from torchdata._utils import ExceptionWrapper
from torchdata.dataloader2.communication.messages import Request, Response

__all__ = [
    "ElasticEpoch",
    "ErrorResponse",
    "GetNextRequest",
    "GetStateRequest",
    "GetStateResponse",
    "ItemsResponse",
    "Level",
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


# --- epoch control --------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """What the user had received when an epoch was resumed elastically, per sharding instance
    ``i`` of ``len(whole)``, counted in the sequence the instances shared: ``whole[i]`` elements
    all of whose items were handed on, and ``partial[i]`` items of the next one (0: none)."""

    whole: Tuple[int, ...]
    partial: Tuple[int, ...]

    @property
    def instances(self) -> int:
        return len(self.whole)


@dataclass(frozen=True)
class ElasticEpoch:
    """An epoch resumed elastically: its ``levels``, and ``head_states``, the graph states
    ``(sharding instance, state)`` that the workers before the last level captured in it, from
    which a new worker may start its pre-sharding part (none for an exact restore of an elastic
    epoch; see :class:`~torchdata_snapshot.graph_state.worker_loop.ElasticWorker`)."""

    levels: Tuple[Level, ...]
    head_states: Tuple[Tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class ResetEpochRequest(Request):
    """Start epoch ``epoch``: seed the graph, reset its iterator, then wait for ``GetNextRequest``.
    ``elastic`` (for an epoch resumed elastically) says which elements of the
    epoch remain for the sharding filter to deal, and which captured states may spare running the
    pre-sharding part from the epoch's start (see :class:`ElasticEpoch`)."""

    seed_generator: Any
    iter_reset_fn: Optional[Callable[[Any], Any]]
    epoch: int = 0
    elastic: Optional[ElasticEpoch] = None


@dataclass(frozen=True)
class ResetEpochResponse(Response):
    """The epoch is reset; nothing of the previous epoch follows. ``serving_since``: when (``time.time()``)
    the worker began to serve, its start done (a restore's log says that start apart)."""

    epoch: Optional[int] = None
    serving_since: Optional[float] = None


@dataclass(frozen=True)
class ReplayRequest(Request):
    """Restore by deterministic replay: produce the first ``skip`` items of the (freshly reset)
    epoch ``epoch`` and drop them; they never leave the process.

    With ``state = (position, blob)`` the graph is first loaded with the state it had after its
    ``position``-th item (stateful restore) and ``skip`` counts from there; ``state_digest`` is
    the stream's running digest at that position (see :mod:`torchdata_snapshot.checkpoint.digest`).
    ``digest`` is the running digest the checkpoint recorded after the last replayed item: the
    replay must end with the same one, or the reply is a ``ReplayDivergenceError``. ``opened``
    holds the files the replayed items opened (pickled tuples of ``FileOrigin``): each is checked
    before anything is replayed, and a changed one is a ``ChangedFileError``. It is a
    request of its own, sent after the dispatching process (if any) was reset too, because a
    worker's replay may need dispatched items of the new epoch.
    """

    epoch: int
    skip: int
    digest: Optional[str] = None
    state: Optional[Tuple[int, bytes]] = None
    state_digest: Optional[str] = None
    opened: Tuple[bytes, ...] = ()


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

    Unlike the queue-based loop's one-request-one-item ``GetNextRequest``, credits accumulate; the window of
    outstanding credit is what prefetching means in this protocol.
    """

    epoch: Optional[int] = None
    count: int = 1


@dataclass(frozen=True)
class ItemsResponse(Response):
    """``count`` items of epoch ``epoch``, in order, pickled one after the other into ``payload``
    (see :class:`~torchdata_snapshot.core.transport.item_codec.ItemEncoder`). With replay verification on,
    ``digests`` holds the stream's running digest after each of them, as ``count`` native
    unsigned 64-bit integers (``array("Q")``; see :mod:`torchdata_snapshot.checkpoint.digest`). ``shared``
    counts the items that hold shared memory (tensors), whose size the payload does not tell.
    ``taken`` holds, per item, how many elements the graph's sharding filter had taken when it
    was yielded (``array("q")``; for elastic resume), when counted, and
    ``partial`` the items of the last of them that the graph's expander had handed on, when it
    has one (see :class:`~torchdata_snapshot.graph_state.worker_loop.ElasticWorker`). ``opened``
    lists, for the items whose production opened files, ``(index in the batch, pickled tuple of
    FileOrigin)``: what a restore checks of the files it reads again (see
    :mod:`torchdata_snapshot.graph_state.file_origins`)."""

    epoch: int
    count: int
    payload: bytes
    digests: Optional[bytes] = None
    shared: int = 0
    taken: Optional[bytes] = None
    partial: Optional[bytes] = None
    opened: Tuple[Tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class StateMarkResponse(Response):
    """The state of the worker's whole graph right after it produced its ``position``-th item of
    epoch ``epoch`` (see :mod:`torchdata_snapshot.graph_state.graph_state`), sent right behind that item; how
    often is paced by the worker (see ``StatefulWorkerLoop._after_item``)."""

    epoch: int
    position: int
    state: bytes


@dataclass(frozen=True)
class StopIterationResponse(Response):
    """The graph is exhausted for epoch ``epoch``; no item follows until the next reset."""

    epoch: Optional[int] = None


@dataclass(frozen=True)
class WorkerExceptionResponse(Response):
    """The graph of epoch ``epoch`` raised; the exception travels as a value and is re-raised where
    it is read. A reader drops it when it belongs to an older epoch, as it drops stale items;
    ``epoch=None`` (the sender is going away, whatever the epoch) is never stale."""

    exc: ExceptionWrapper
    epoch: Optional[int] = None


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
    """Stop producing after the current item; apply ``pause_fn`` to the graph (DataLoader2's semantics)."""

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
    """DataLoader2's limit: apply ``limit_fn(graph, worker_num_batches)`` inside the process."""

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
    """A process's :class:`WorkerSnapshot`. ``dispatcher`` holds the snapshots of the dispatching
    process's loops that a worker asked itself before answering (the queue-based loop does; the
    streaming reading service asks the dispatching process directly and leaves it empty)."""

    snapshot: Any
    dispatcher: Tuple[Any, ...] = ()


@dataclass(frozen=True)
class TerminateRequest(Request):
    pass


@dataclass(frozen=True)
class TerminateResponse(Response):
    pass
