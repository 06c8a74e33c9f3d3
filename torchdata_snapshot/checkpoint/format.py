"""The reading service's checkpoint: versioned plain data, built, validated and checked here.

``MultiProcessingReadingService.checkpoint()`` returns a ``dict`` of ints, floats, strings, bools,
bytes, lists and dicts only (no pickled object of ours), so that it survives ``torch.save``/``torch.load``
(also with ``weights_only=True``) and ``pickle``, and validating it runs no code. Its size does
not grow with the position in the epoch: it holds counters, seeds, running digests and, with
stateful restore, one graph state per worker (``bytes``: the pickled states of its DataPipes, which hold
data only where the DataPipe does, e.g. a shuffle buffer). Those bytes are unpickled by the
worker on restore, as the serialized pipeline ``DataLoader2.state_dict()`` stores beside this
state is unpickled by ``DataLoader2``: a checkpoint is as trusted as that pickle.

Keys (``Checkpoint.to_plain()``)::

    format        "torchdata_snapshot.MultiProcessingReadingService"
    version       FORMAT_VERSION (an int; other versions are refused with a clear error)
    num_workers   the number of workers the state was taken with
    fingerprint   digest of the pipeline's structure (``identity.graph_fingerprint``)
    arguments     per DataPipe (by ``datapipe_key``, e.g. "0:BatcherIterDataPipe"), the plain
                  constructor arguments that determine its data, wherever it keeps them, in
                  their compared form ({"batch_size": 4, "drop_last": false}; {"mode": "rt",
                  "encoding": null}; see NOTE [ Argument readings ] in ``checkpoint.arguments``), or None
                  (not recorded: a reading service that has not run)
    epoch         number of the epoch the state belongs to (-1 before the first)
    status        "idle" (no epoch started), "in_epoch", or "finished" (StopIteration reached the user)
    seed          SeedGenerator state at the start of the epoch (``seeds.seed_state``), or None
    delivered     items the user received in this epoch
    replay_in_main  true when the main process replays ``delivered`` items itself (num_workers=0,
                  or a main-process tail that is not one-to-one); the workers then restart at 0
    digest        running digest (16 hex digits, see ``torchdata_snapshot.checkpoint.digest``) of the
                  ``delivered`` items (main-process replay), or None
    workers       per worker: {"delivered": items of its stream the user received,
                               "digest": the stream's running digest after them, or None,
                               "state": its graph state after an earlier item, or None:
                                        {"position": that item (1 <= position < delivered),
                                         "blob": bytes, "digest": running digest there, or None},
                               "taken": elements its sharding filter had taken when the last of
                                        them was yielded, or None (not counted),
                               "partial": items of the last of those elements that the one-to-many
                                        DataPipe after the filter had handed on then, or None
                                        (the graph has none: each element was handed on whole),
                               "opened": the files the items after "state" (or from the epoch's
                                        start) opened, one bytes per item that opened some (pickled
                                        FileOrigins, checked by the worker before it replays)}
    next_worker   the worker the round-robin asks next
    sharding      {"world_size": W, "rank": r}: the ranks DistributedReadingService sharded over
                  (1 and 0 without it), or None (unknown)
    remaining     what earlier elastic resumes of this epoch had delivered, one ``Level`` per
                  resume: {"whole": elements handed on whole, "partial": items handed on of the
                  next element}, one count per sharding instance in each (elastic resume)
    ranks         every rank's own state (these keys, "ranks" None) by rank (``gather_elastic_state``),
                  or None (not gathered): a rank of a job of the same world size resumes its own
                  exactly; another world size deals the rest of the epoch from every rank's positions
    checksum      digest of all the above; any change to the state is detected

Digests are ``None`` where replay verification was off, or nothing was delivered. Only this
format version is read: the earlier ones were written by development builds before the first
release, and a state of another version is refused naming both versions.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Literal, Optional, Tuple

from torchdata_snapshot._errors import IncompatibleCheckpointError, InvalidCheckpointError
from torchdata_snapshot.checkpoint.arguments import Arguments, argument_changes, structure_change
from torchdata_snapshot.checkpoint.identity import GraphIdentity
from torchdata_snapshot.checkpoint.seeds import check_seed_state
from torchdata_snapshot.core.graph import NOT_PLAIN, plain_data
from torchdata_snapshot.core.messages import Level

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Arguments",
    "Checkpoint",
    "CapturedState",
    "ShardingProgress",
    "WorkerPosition",
]

FORMAT = "torchdata_snapshot.MultiProcessingReadingService"
#: 10: a gathered state holds every rank's whole state, not only its positions (a version-9
#: gathered state resumed another rank with the rank's own stream).
FORMAT_VERSION = 10

#: Where the run stood: no epoch started yet, in an epoch, or the epoch's end reached the user.
Status = Literal["idle", "in_epoch", "finished"]
STATUSES: Tuple[Status, ...] = ("idle", "in_epoch", "finished")

#: ``(position, blob, digest)``: the pickled state of a worker's graph right after its
#: ``position``-th item, and the stream's running digest there (``None`` if unknown).
CapturedState = Tuple[int, bytes, Optional[str]]

_DIGEST = re.compile(r"^[0-9a-f]{16}$")
_KEYS = (
    "format",
    "version",
    "num_workers",
    "fingerprint",
    "arguments",
    "epoch",
    "status",
    "seed",
    "delivered",
    "replay_in_main",
    "digest",
    "workers",
    "next_worker",
    "sharding",
    "remaining",
    "ranks",
    "checksum",
)

_WORKER_KEYS = {"delivered", "digest", "state", "taken", "partial", "opened"}

#: ``(taken, partial)`` of one worker: see :class:`WorkerPosition`.
ShardingProgress = Tuple[Optional[int], Optional[int]]


@dataclass(frozen=True)
class WorkerPosition:
    """How far the user got into one worker's stream: ``delivered`` items, the stream's running
    ``digest`` after them, the latest captured ``state`` of the worker's graph before them, and
    the elements its sharding filter had ``taken`` when the last of them was yielded, and the
    items of the last of those elements the graph's one-to-many DataPipe after the filter had
    handed on then (``partial``; ``None`` without one: each element is handed on whole), and the
    files the items after ``state`` opened (``opened``: packed FileOrigins, one per item that
    opened some; see :func:`torchdata_snapshot.graph_state.file_origins.check_opened`)."""

    delivered: int = 0
    digest: Optional[str] = None
    state: Optional[CapturedState] = None
    taken: Optional[int] = None
    partial: Optional[int] = None
    opened: Tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Checkpoint:
    """The reading service's state; see the module docstring for the meaning of each field."""

    num_workers: int
    graph: GraphIdentity
    epoch: int = -1
    status: Status = "idle"
    seed: Optional[Dict[str, Any]] = None
    delivered: int = 0
    replay_in_main: bool = False
    digest: Optional[str] = None
    workers: Tuple[WorkerPosition, ...] = field(default_factory=tuple)
    next_worker: int = 0
    #: ``(world_size, rank)`` of the sharding, ``None`` if unknown.
    sharding: Optional[Tuple[int, int]] = (1, 0)
    remaining: Tuple[Level, ...] = ()
    #: Every rank's own state (each with ``ranks`` ``None``), by rank, when gathered.
    ranks: Optional[Tuple[Checkpoint, ...]] = None

    def for_rank(self, sharding: Tuple[int, int]) -> Checkpoint:
        """The state rank ``sharding[1]`` of a job of ``sharding[0]`` ranks resumes: this one, or if
        gathered in a job of as many ranks, that rank's own entry (still gathered, for elastic)."""
        if self.ranks is None or self.sharding is None or self.sharding[0] != sharding[0]:
            return self
        return replace(self.ranks[sharding[1]], ranks=self.ranks)

    def to_plain(self) -> Dict[str, Any]:
        plain: Dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "num_workers": self.num_workers,
            "fingerprint": self.graph.fingerprint,
            "arguments": None
            if self.graph.arguments is None
            else {key: dict(arguments) for key, arguments in self.graph.arguments.items()},
            "epoch": self.epoch,
            "status": self.status,
            "seed": self.seed,
            "delivered": self.delivered,
            "replay_in_main": self.replay_in_main,
            "digest": self.digest,
            "workers": [
                {
                    "delivered": w.delivered,
                    "digest": w.digest,
                    "state": None
                    if w.state is None
                    else {"position": w.state[0], "blob": w.state[1], "digest": w.state[2]},
                    "taken": w.taken,
                    "partial": w.partial,
                    "opened": list(w.opened),
                }
                for w in self.workers
            ],
            "next_worker": self.next_worker,
            "sharding": None
            if self.sharding is None
            else {"world_size": self.sharding[0], "rank": self.sharding[1]},
            "remaining": [
                {"whole": list(level.whole), "partial": list(level.partial)} for level in self.remaining
            ],
            "ranks": None if self.ranks is None else [rank.to_plain() for rank in self.ranks],
        }
        plain["checksum"] = _checksum(plain)
        return plain

    @classmethod
    def from_plain(cls, state: Any) -> Checkpoint:
        """Validate ``state`` against the schema; raise :class:`InvalidCheckpointError` naming the problem."""
        if isinstance(state, (bytes, bytearray)):
            raise InvalidCheckpointError(
                "the reading-service state is bytes, not the plain dict that "
                "MultiProcessingReadingService.checkpoint() returns: it was taken with another "
                "reading service (torchdata's MultiProcessingReadingService has no mid-epoch state)"
            )
        if not isinstance(state, dict):
            raise InvalidCheckpointError(
                f"the reading-service state must be a dict, got {type(state).__name__}"
            )
        if state.get("format") != FORMAT:
            raise InvalidCheckpointError(
                f"not a checkpoint of this reading service: format is {state.get('format')!r}, "
                f"expected {FORMAT!r}"
            )
        version = state.get("version")
        if not _is_int(version) or version != FORMAT_VERSION:
            raise InvalidCheckpointError(
                f"the checkpoint has format version {version!r}; this reading service reads version "
                f"{FORMAT_VERSION}"
            )
        keys = _KEYS
        missing = [key for key in keys if key not in state]
        if missing:
            raise InvalidCheckpointError(f"the checkpoint is truncated: missing {', '.join(missing)}")
        extra = sorted(set(state) - set(keys), key=str)
        if extra:
            raise InvalidCheckpointError(f"the checkpoint has unknown fields: {', '.join(map(str, extra))}")
        if state["checksum"] != _checksum(state):
            raise InvalidCheckpointError(
                "the checkpoint's checksum does not match its content: it was modified or corrupted"
            )
        num_workers = _count(state, "num_workers")
        workers = state["workers"]
        if not isinstance(workers, list) or len(workers) != num_workers:
            raise InvalidCheckpointError(f"'workers' must list {num_workers} positions, got {workers!r}")
        positions = []
        for i, w in enumerate(workers):
            if not isinstance(w, dict) or set(w) != _WORKER_KEYS:
                raise InvalidCheckpointError(
                    f"workers[{i}] must have 'delivered', 'digest', 'state', 'taken', 'partial' and "
                    f"'opened', got {w!r:.300}"
                )
            delivered = _count(w, "delivered", f"workers[{i}]")
            graph_state = _graph_state(w["state"], f"workers[{i}]")
            if graph_state is not None and graph_state[0] > delivered:
                raise InvalidCheckpointError(f"the state of workers[{i}] is ahead of what the user received")
            taken = None if w["taken"] is None else _count(w, "taken", f"workers[{i}]")
            partial = None if w["partial"] is None else _count(w, "partial", f"workers[{i}]")
            opened = w["opened"]
            if not isinstance(opened, list) or not all(isinstance(blob, bytes) for blob in opened):
                raise InvalidCheckpointError(f"'opened' of workers[{i}] must be a list of bytes")
            digest = _digest(w["digest"], f"workers[{i}]")
            positions.append(WorkerPosition(delivered, digest, graph_state, taken, partial, tuple(opened)))
        status = state["status"]
        if status not in STATUSES:
            raise InvalidCheckpointError(f"'status' must be one of {STATUSES}, got {status!r}")
        epoch = state["epoch"]
        if not _is_int(epoch) or epoch < -1:
            raise InvalidCheckpointError(f"'epoch' must be an int >= -1, got {epoch!r}")
        next_worker = _count(state, "next_worker")
        if num_workers and next_worker >= num_workers:
            raise InvalidCheckpointError(f"'next_worker' must be < num_workers, got {next_worker}")
        if not isinstance(state["fingerprint"], str):
            raise InvalidCheckpointError("'fingerprint' must be a string")
        graph = GraphIdentity(state["fingerprint"], _arguments(state["arguments"]))
        if not isinstance(state["replay_in_main"], bool):
            raise InvalidCheckpointError("'replay_in_main' must be a bool")
        seed = state["seed"]
        if seed is not None:
            check_seed_state(seed)
        elif status == "in_epoch":
            raise InvalidCheckpointError("a state taken in an epoch must record the epoch's seed")
        delivered = _count(state, "delivered")
        if (
            status == "in_epoch"
            and not state["replay_in_main"]
            and delivered != sum(p.delivered for p in positions)
        ):
            raise InvalidCheckpointError(
                f"'delivered' ({delivered}) must be what the workers' streams delivered, "
                f"{sum(p.delivered for p in positions)}"
            )
        sharding = _sharding(state["sharding"])
        own = cls(
            num_workers=num_workers,
            graph=graph,
            epoch=epoch,
            status=status,
            seed=seed,
            delivered=delivered,
            replay_in_main=state["replay_in_main"],
            digest=_digest(state["digest"], "the state"),
            workers=tuple(positions),
            next_worker=next_worker,
            sharding=sharding,
            remaining=_remaining(state["remaining"]),
        )
        if state["ranks"] is None:
            return own
        return replace(own, ranks=_ranks(state["ranks"], own))

    def check_fits(self, num_workers: int, graph: GraphIdentity, sharding: Tuple[int, int] = (1, 0)) -> None:
        """Raise :class:`IncompatibleCheckpointError` unless this state fits the given service
        and pipeline (``sharding``: its ``(world_size, rank)``) for an exact resume."""
        if self.num_workers != num_workers:
            raise IncompatibleCheckpointError(
                f"the checkpoint was taken with num_workers={self.num_workers}, this reading service has "
                f"num_workers={num_workers}: each worker's position belongs to its shard, so an exact resume "
                "keeps the number of workers (prefetch counts and the start method can change); "
                "MultiProcessingReadingService(..., elastic=True) resumes the epoch with another number"
            )
        if self.sharding is not None and self.sharding[0] != sharding[0]:
            raise IncompatibleCheckpointError(
                f"the checkpoint was taken with world_size={self.sharding[0]}, this job has "
                f"world_size={sharding[0]}: each rank's position belongs to its shard, so an exact resume "
                "keeps the world size; MultiProcessingReadingService(..., elastic=True) resumes the epoch "
                "with another one (see torchdata_snapshot.gather_elastic_state)"
            )
        if self.sharding is not None and self.sharding[1] != sharding[1]:
            raise IncompatibleCheckpointError(
                f"the checkpoint was taken on rank {self.sharding[1]} of {self.sharding[0]}, this is rank "
                f"{sharding[1]}: each rank's position belongs to its shard, so every rank loads the state "
                "it took itself (a file or key per rank), or the state "
                "torchdata_snapshot.gather_elastic_state(dl.state_dict()) returns, which resumes any rank"
            )
        self.check_graph(graph)

    def check_graph(self, graph: GraphIdentity) -> None:
        """Raise :class:`IncompatibleCheckpointError` unless the state belongs to this graph: the same
        structure and recorded arguments (the message names the DataPipes and arguments that differ)."""
        changes = argument_changes(self.graph.arguments, graph.arguments, graph.readings)
        if self.graph.fingerprint != graph.fingerprint:
            what = structure_change(self.graph.arguments, graph.arguments, changes)
            raise IncompatibleCheckpointError(
                f"the checkpoint was taken with another pipeline ({what}; structure fingerprint "
                f"{self.graph.fingerprint}, this one is {graph.fingerprint}): restore it with the DataPipe "
                "graph it was taken with"
            )
        if changes:
            raise IncompatibleCheckpointError(
                f"the checkpoint was taken with other arguments of its DataPipes ({'; '.join(changes)}): "
                "restore it with the arguments it was taken with"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(state: Dict[str, Any], key: str, where: str = "the state") -> int:
    value = state[key]
    if not _is_int(value) or value < 0:
        raise InvalidCheckpointError(f"{key!r} of {where} must be a non-negative int, got {value!r}")
    return value


def _digest(value: Any, where: str) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise InvalidCheckpointError(f"the digest of {where} must be 16 hex digits or None, got {value!r}")
    return value


def _graph_state(value: Any, where: str) -> Optional[CapturedState]:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or set(value) != {"position", "blob", "digest"}
        or not _is_int(value["position"])
        or value["position"] < 1
        or not isinstance(value["blob"], bytes)
    ):
        raise InvalidCheckpointError(
            f"the state of {where} must be {{'position': int >= 1, 'blob': bytes, 'digest': str or None}}"
        )
    return (value["position"], value["blob"], _digest(value["digest"], f"the state of {where}"))


def _sharding(value: Any) -> Optional[Tuple[int, int]]:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"world_size", "rank"}:
        raise InvalidCheckpointError(
            f"'sharding' must be {{'world_size': int, 'rank': int}} or None, got {value!r:.200}"
        )
    world_size, rank = _count(value, "world_size", "'sharding'"), _count(value, "rank", "'sharding'")
    if not rank < world_size:
        raise InvalidCheckpointError(f"'sharding': rank {rank} is not below world_size {world_size}")
    return world_size, rank


def _counts(value: Any, where: str, length: Optional[int] = None) -> Tuple[int, ...]:
    """A list of non-negative ints, of ``length`` if given."""
    if (
        not isinstance(value, list)
        or (length is not None and len(value) != length)
        or not all(_is_int(v) and v >= 0 for v in value)
    ):
        wanted = f"{length} " if length is not None else ""
        raise InvalidCheckpointError(
            f"{where} must be a list of {wanted}non-negative ints, got {value!r:.200}"
        )
    return tuple(value)


def _remaining(value: Any) -> Tuple[Level, ...]:
    if not isinstance(value, list):
        raise InvalidCheckpointError(f"'remaining' must be a list, got {value!r:.200}")
    levels = []
    for i, level in enumerate(value):
        if not isinstance(level, dict) or set(level) != {"whole", "partial"}:
            raise InvalidCheckpointError(
                f"remaining[{i}] must be {{'whole': [int, ...], 'partial': [int, ...]}}, got {level!r:.200}"
            )
        whole = _counts(level["whole"], f"remaining[{i}]['whole']")
        if not whole:
            raise InvalidCheckpointError("'remaining' lists an elastic resume with no sharding instance")
        levels.append(Level(whole, _counts(level["partial"], f"remaining[{i}]['partial']", len(whole))))
    return tuple(levels)


def _ranks(value: Any, own: Checkpoint) -> Tuple[Checkpoint, ...]:
    """Every rank's state of a gathered one: one per rank of ``own``'s job, each of that rank,
    not gathered itself, of the same epoch and layout, and ``own``'s rank's equal to ``own``."""
    count = own.sharding[0] if own.sharding else None
    if own.sharding is None or not isinstance(value, list) or len(value) != count:
        raise InvalidCheckpointError(
            f"'ranks' must list the state of every rank of the job's {count} ranks or be None"
        )
    ranks = []
    for r, plain in enumerate(value):
        try:
            rank = Checkpoint.from_plain(plain)
        except InvalidCheckpointError as e:
            raise InvalidCheckpointError(f"ranks[{r}]: {e}") from None
        if (
            rank.ranks is not None
            or rank.sharding != (own.sharding[0], r)
            or (rank.epoch, rank.status, rank.num_workers) != (own.epoch, own.status, own.num_workers)
            or rank.graph.fingerprint != own.graph.fingerprint
        ):
            raise InvalidCheckpointError(
                f"ranks[{r}] must be rank {r}'s own state, of the same epoch, workers and pipeline"
            )
        ranks.append(rank)
    if ranks[own.sharding[1]] != own:
        raise InvalidCheckpointError(f"ranks[{own.sharding[1]}] must be this rank's own state")
    return tuple(ranks)


def _arguments(value: Any) -> Optional[Arguments]:
    if value is None:
        return None
    if not (
        isinstance(value, dict)
        and all(
            isinstance(key, str)
            and isinstance(arguments, dict)
            and all(
                isinstance(name, str) and plain_data(v, sys.maxsize) is not NOT_PLAIN
                for name, v in arguments.items()
            )
            for key, arguments in value.items()
        )
    ):
        raise InvalidCheckpointError(
            "'arguments' must map each DataPipe to a dict of its arguments (plain data) or be None, "
            f"got {value!r:.200}"
        )
    return value


def _checksum(state: Dict[str, Any]) -> str:
    content = {key: value for key, value in state.items() if key != "checksum"}
    h = hashlib.blake2b(digest_size=8)

    def blobs(value: Any) -> str:  # bytes are hashed beside the JSON, not hex-encoded into it
        if not isinstance(value, bytes):
            raise TypeError(f"not plain data: {type(value).__name__}")
        h.update(value)
        return f"<{len(value)} bytes>"

    h.update(json.dumps(content, sort_keys=True, separators=(",", ":"), default=blobs).encode())
    return h.hexdigest()
