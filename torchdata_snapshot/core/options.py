"""The reading service's options, grouped by what they govern; each group validates itself.

``MultiProcessingReadingService`` takes :class:`BatchingOptions` as ``batching=`` and the fields
of :class:`RestoreOptions` and :class:`FaultOptions` as its own keywords (one spelling each);
:class:`WorkerOptions` is what every worker process receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple, Type, TypeVar

import torch.multiprocessing as mp
from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._constants import (
    ALIGN_BYTES,
    DEFAULT_CONTROL_TIMEOUT_S,
    DEFAULT_MAX_ITEMS_BETWEEN_CAPTURES,
    TENSOR_POOL_START_SLOT_BYTES,
)

__all__ = [
    "BatchingOptions",
    "FaultOptions",
    "RestoreOptions",
    "RuntimeOptions",
    "TensorPoolOptions",
    "WorkerOptions",
    "check_start_method",
    "check_type",
]

T = TypeVar("T")


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_type(name: str, value: Any, kind: Type[T]) -> T:
    """``value``, if it is a ``kind``; else ``TypeError`` naming the argument."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {value!r:.100}")
    return value


def check_start_method(method: Optional[str]) -> Optional[str]:
    """``method``, if ``None`` (the platform's default) or a start method of this platform."""
    if method is not None and method not in mp.get_all_start_methods():
        raise ValueError(
            f"multiprocessing_context must be one of {mp.get_all_start_methods()}, got {method!r}"
        )
    return method


@dataclass(frozen=True)
class BatchingOptions:
    """How items are grouped into messages.

    A worker hands every item to its outbox thread as soon as it is produced; the thread sends
    whatever has accumulated as one message, of at most ``max_items`` items, closed once it
    holds ``max_bytes`` pickled bytes. Slow items therefore go out one by one and tiny items in
    batches, and no item waits for the next one. The dispatching process, which has no outbox
    thread, also sends what it produced after at most ``max_delay_s`` of producing.

    Args:
        max_items: at most this many items in one message.
        max_bytes: a message is closed once it holds this many pickled bytes.
        max_delay_s: the dispatching process sends what it produced after this long at most.
    """

    max_items: int = 64
    max_bytes: int = 1 << 20
    max_delay_s: float = 0.001

    def __post_init__(self) -> None:
        if self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if self.max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {self.max_delay_s}")


@dataclass(frozen=True)
class RestoreOptions:
    """How checkpoints are taken and restored.

    Attributes:
        verify_replay: keep a running digest of every item of each stream (about 0.1 us per
            small item) and, on restore, check that the replayed items reproduce the one the
            checkpoint recorded at the user's position; raise
            :class:`~torchdata_snapshot.ReplayDivergenceError` if they do not.
        max_items_between_captures: stateful restore: when every DataPipe of a worker's graph can report and
            load its state (see the docs' contract page), the worker captures it after its
            first item and then as often as 1% of its production time allows, at most
            ``max_items_between_captures`` items apart; a restore loads the latest one instead of replaying
            the epoch, so what it replays takes at most 100 captures' time (or one item) at any
            position.
        stateful: ``None`` restores from states where the graph allows it and replays elsewhere;
            ``False`` always replays and captures nothing; ``True`` requires it (a graph that
            cannot is an error at the first ``iter()``; so is ``sharding_round_robin_dispatch``).
    """

    verify_replay: bool = True
    max_items_between_captures: int = DEFAULT_MAX_ITEMS_BETWEEN_CAPTURES
    stateful: Optional[bool] = None

    def __post_init__(self) -> None:
        if not isinstance(self.verify_replay, bool):
            raise TypeError(f"verify_replay must be a bool, got {self.verify_replay!r}")
        if _check_count("max_items_between_captures", self.max_items_between_captures) < 1:
            raise ValueError(
                "max_items_between_captures must be >= 1 (stateful=False turns state captures off)"
            )
        if self.stateful not in (None, True, False):
            raise ValueError(f"stateful must be None, True or False, got {self.stateful!r}")


@dataclass(frozen=True)
class FaultOptions:
    """Bounds on waiting for the processes, and self-healing.

    Attributes:
        control_timeout_s: bound on waiting for the answer to a control request (pause, state,
            epoch reset) of a process that is stuck: one that uses CPU time meanwhile gets it again
            (see ``Channel.recv``); a worker answers between two items. A process's first answer,
            which waits for it to start, gets at least ``STARTUP_TIMEOUT_S`` (120 s).
        timeout_s: bound on waiting for one item (``None``: as long as the worker lives, like
            ``torch.utils.data.DataLoader``'s ``timeout=0``). A dead worker is detected either way.
        restart_dead_workers: self-healing: how many times per epoch a worker that dies may be
            replaced by a new process, which replays its stream (inside itself) to what the main
            process already received and continues; the data is exactly what the dead worker
            would have produced. ``0`` raises :class:`~torchdata_snapshot.WorkerDiedError`
            instead. Not available with ``sharding_round_robin_dispatch``; a
            ``pause_fn``/``limit_fn`` applied to the dead worker's graph is not applied again.
    """

    control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    timeout_s: Optional[float] = None
    restart_dead_workers: int = 0

    def __post_init__(self) -> None:
        if not self.control_timeout_s > 0:
            raise ValueError(f"control_timeout_s must be > 0, got {self.control_timeout_s}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")
        _check_count("restart_dead_workers", self.restart_dead_workers)


@dataclass(frozen=True)
class WorkerOptions:
    """What every worker needs besides its graph; picklable (sent to spawned workers)."""

    custom_init_fn: Optional[Callable[[DataPipe, WorkerInfo], DataPipe]] = None
    custom_reset_fn: Optional[Callable[..., DataPipe]] = None
    batching: BatchingOptions = field(default_factory=BatchingOptions)
    restore: RestoreOptions = field(default_factory=RestoreOptions)


@dataclass(frozen=True)
class RuntimeOptions:
    """Where and how the reading service runs the graph: in ``num_workers`` worker processes
    started by ``multiprocessing_context`` (``None``: the platform's default), each with
    ``prefetch`` = ``(worker_prefetch_cnt, main_prefetch_cnt)``, the ``worker`` and ``faults``
    options, and a tensor pool of slots of ``tensor_pool_slot_bytes`` (``None``: no pool); or,
    with ``num_workers=0``, in this process, its global RNG states isolated from the training
    loop's (``isolate_rng``), items produced ahead within one swap of them (``read_ahead``)."""

    num_workers: int = 0
    multiprocessing_context: Optional[str] = None
    prefetch: Tuple[int, int] = (10, 10)
    worker: WorkerOptions = field(default_factory=WorkerOptions)
    faults: FaultOptions = field(default_factory=FaultOptions)
    isolate_rng: bool = True
    read_ahead: bool = False
    tensor_pool_slot_bytes: Optional[int] = None


@dataclass(frozen=True)
class TensorPoolOptions:
    """The pool of one worker: ``slots`` slots, each holding the tensors of one item in up to
    ``max_slot_bytes`` bytes. A slot starts at ``slot_bytes`` (at most ``max_slot_bytes``); an item
    whose tensors do not fit takes the usual path and grows the slots for later items, up to
    ``max_slot_bytes`` (see NOTE [ Tensor pool ], "Sizes")."""

    slots: int
    max_slot_bytes: int
    slot_bytes: int = TENSOR_POOL_START_SLOT_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"the tensor pool needs >= 1 slot, got {self.slots!r}")
        for name, value in (("tensor_pool_slot_bytes", self.max_slot_bytes), ("slot_bytes", self.slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < ALIGN_BYTES:
                raise ValueError(f"{name} must be an int >= {ALIGN_BYTES}, got {value!r}")

    @property
    def max_bytes(self) -> int:
        """The most memory the pool's slots may hold: every slot grown to its bound."""
        return self.slots * self.max_slot_bytes

    @classmethod
    def for_window(cls, window: int, max_slot_bytes: int) -> TensorPoolOptions:
        """Twice the credit window (at least 4): the items in flight and as many held downstream."""
        return cls(max(4, 2 * window), max_slot_bytes, min(TENSOR_POOL_START_SLOT_BYTES, max_slot_bytes))
