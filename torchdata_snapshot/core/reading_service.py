"""``MultiProcessingReadingService``: a drop-in, observable replacement for torchdata's own.

The reading service only answers DataLoader2's calls: between ``initialize`` and ``finalize``
a :class:`~torchdata_snapshot.core.session.Session` holds the graph's
:class:`~torchdata_snapshot.core.main.runtime.Runtime` (in the main process, ``num_workers=0``, or in
worker processes) behind an :class:`~torchdata_snapshot.core.main.outlet.Outlet` that counts what the
user received, and the epoch in progress. It is the most capable session installed (see
:mod:`torchdata_snapshot.core.plugins`): the checkpoint's takes and restores checkpoints, the
core's only streams. The protocol is described in NOTE [ Snapshot protocol ]
(:mod:`torchdata_snapshot.core.messages`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Type

from torchdata.dataloader2 import reading_service as torchdata_rs
from torchdata.dataloader2.graph import DataPipe
from torchdata.dataloader2.random import SeedGenerator
from torchdata.dataloader2.reading_service import CheckpointableReadingServiceInterface
from torchdata.dataloader2.utils.worker import WorkerInfo

from torchdata_snapshot._constants import (
    DEFAULT_CONTROL_TIMEOUT_S,
    DEFAULT_MAX_ITEMS_BETWEEN_CAPTURES,
    JOIN_TIMEOUT_S,
    TENSOR_POOL_SLOT_BYTES,
)
from torchdata_snapshot._errors import ReadingServiceClosedError, ReadingServiceError
from torchdata_snapshot._worker_snapshot import WorkerSnapshot
from torchdata_snapshot.core.main.runtime import shut_down_when_broken
from torchdata_snapshot.core.options import (
    BatchingOptions,
    FaultOptions,
    RestoreOptions,
    RuntimeOptions,
    TensorPoolOptions,
    WorkerOptions,
    _check_count,
    check_start_method,
    check_type,
)
from torchdata_snapshot.core.plugins import FEATURES, installed, require, uses_tensor_pool
from torchdata_snapshot.core.session import Session

__all__ = ["MultiProcessingReadingService"]


def _session_class() -> Type[Session]:
    """The most capable session installed: the checkpoint's, else the core's (which streams)."""
    return installed().session or Session


# SequentialReadingService(DistributedReadingService(), ours) warns at every state_dict() that the
# DistributedReadingService "doesn't support `checkpoint`, skipping...", and at a restore that it
# initializes "from scratch": it has no state of its own to keep (its rank and world size come from
# the process group again), and this reading service's state records the shard it read. The warning
# reads as an incomplete checkpoint on a complete one; only that class's is silenced.
warnings.filterwarnings(
    "ignore",
    message=r"<torchdata\.dataloader2\.reading_service\.DistributedReadingService object at \w+> "
    r"doesn't support `(checkpoint|restore)`",
    category=UserWarning,
)


class MultiProcessingReadingService(
    torchdata_rs.MultiProcessingReadingService, CheckpointableReadingServiceInterface
):
    r"""Runs the replicable part of a ``DataPipe`` graph in worker processes; checkpointable mid-epoch.

    Same constructor and behaviour as ``torchdata.dataloader2.MultiProcessingReadingService``,
    plus :meth:`snapshot` (the RFC: one :class:`~torchdata_snapshot.WorkerSnapshot` per worker)
    and :meth:`checkpoint`/:meth:`restore`, through which ``DataLoader2.state_dict()``,
    ``DataLoader2.from_state()`` and ``DataLoader2.load_state_dict()`` (the pipeline pickled in
    the state) and :func:`load_state_dict` (the loader's own pipeline) resume an epoch exactly
    where the user stopped. Items move between processes in batches under credit-based flow
    control, without polling.

    The arguments after ``worker_reset_fn`` are keyword-only.

    Args:
        num_workers: number of worker processes; ``0`` runs the graph in the main process.
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (default: the
            platform's default).
        worker_prefetch_cnt: items each worker may produce ahead of the main process's requests
            (small items: up to 256 KiB of them, at most 512; see the docs' design page).
        main_prefetch_cnt: items the main process asks for ahead of the user, spread over workers.
        worker_init_fn: called in each worker with ``(datapipe, WorkerInfo)`` when it starts.
        worker_reset_fn: called in each worker with ``(datapipe, WorkerInfo, SeedGenerator)`` at
            the start of every epoch.
        batching: how workers group items into messages (:class:`BatchingOptions`).
        verify_replay: check, on restore, that what is replayed reproduces what the user had
            received (a running digest of each stream); raise
            :class:`~torchdata_snapshot.ReplayDivergenceError` if it does not. ``False`` saves
            the digest's cost and accepts whatever a restore replays: for a pipeline that does
            not replay, other data than the interrupted run's, without an error.
        stateful: restore from captured graph states where the graph allows it (``None``, the
            default) and replay elsewhere; ``False`` always replays (and captures nothing);
            ``True`` requires it (a graph that cannot is an error at the first ``iter()``).
        max_items_between_captures: at most this many items between two captures of a worker's graph
            state (captures are otherwise paced to 1% of the worker's time).
        control_timeout_s: bound on waiting for the answer to a control request (pause, state,
            epoch reset) of a stuck process (one that computes meanwhile gets it again); a
            process's first answer gets at least 120 s (it may be starting).
        timeout_s: bound on waiting for one item (``None``: as long as the worker lives).
        restart_dead_workers: self-healing: how many times per epoch a worker that dies may be
            replaced by a new process that replays its stream (see the reliability page).
        isolate_rng: with ``num_workers=0``, give the pipeline its own ``random``/``torch``/
            ``numpy`` global RNG states, seeded like a worker's and swapped in around each item:
            the training loop's draws never change the data and a restored epoch replays exactly
            (costs and limits: see the contract and performance pages). ``False``: torchdata's.
        read_ahead: with ``num_workers=0`` and ``isolate_rng``, produce items ahead of the user
            within one swap of the RNG states, for throughput on cheap items; same data and
            checkpoints, but the pipeline's side effects happen up to a batch of items early (see
            the performance page). Default: each item is produced when asked for.
        elastic: let a restore resume an epoch checkpointed with another ``num_workers`` (or,
            under ``DistributedReadingService``, another world size): the rest of the epoch
            delivers each element the user had not received exactly once, dealt over the new
            workers (see the docs' elastic resume page). Without it such a checkpoint is refused.
        tensor_pool: workers copy the tensors of an item into a slot of a recycled shared-memory
            pool (one per worker, ``2 x`` the per-worker prefetch window in slots), and the main
            process hands out tensors that view the slot instead of receiving a new shared-memory
            segment per tensor: several times faster for tensors of 64 KB and more. A slot goes
            back to its worker when the last tensor viewing it is freed and every process forked
            while it lived has exited (see the docs' contract page); tensors that do not fit, are
            not contiguous CPU tensors, require grad, or arrive while the user (or forked
            processes) hold every slot take the usual path. Tensors of one item that shared a
            storage arrive as separate copies. Numpy arrays travel the same way (see the docs'
            performance page). ``None`` (the default): on where the platform has it (Linux) and
            the ``tensor_pool`` folder is installed, else off; ``True``: required (``ValueError``
            naming the platform or the missing folder where it cannot be); ``False``: off.
        tensor_pool_slot_bytes: the most a slot may grow to: slots start at 1 MiB and grow to fit
            the items seen (an item that does not fit takes the usual path and grows the slots for
            the next ones); the tensors of one item (or batch) larger than this always take the
            usual path (default 64 MiB). A pool holds at most its slots times this, and in
            practice its slots times the largest item seen (see the docs' performance page).
    """

    def __init__(
        self,
        num_workers: int = 0,
        multiprocessing_context: Optional[str] = None,
        worker_prefetch_cnt: int = 10,
        main_prefetch_cnt: int = 10,
        worker_init_fn: Optional[Callable[[DataPipe, WorkerInfo], DataPipe]] = None,
        worker_reset_fn: Optional[Callable[[DataPipe, WorkerInfo, SeedGenerator], DataPipe]] = None,
        *,
        batching: BatchingOptions = BatchingOptions(),
        verify_replay: bool = True,
        stateful: Optional[bool] = None,
        max_items_between_captures: int = DEFAULT_MAX_ITEMS_BETWEEN_CAPTURES,
        control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
        timeout_s: Optional[float] = None,
        restart_dead_workers: int = 0,
        isolate_rng: bool = True,
        read_ahead: bool = False,
        elastic: bool = False,
        tensor_pool: Optional[bool] = None,
        tensor_pool_slot_bytes: int = TENSOR_POOL_SLOT_BYTES,
    ) -> None:
        # The base class's __init__ is not called: it asserts instead of raising and warns that
        # num_workers=0 should use InProcessReadingService, which is not true here.
        self.num_workers = _check_count("num_workers", num_workers)
        self.multiprocessing_context = check_start_method(multiprocessing_context)
        self.worker_prefetch_cnt = _check_count("worker_prefetch_cnt", worker_prefetch_cnt)
        self.main_prefetch_cnt = _check_count("main_prefetch_cnt", main_prefetch_cnt)
        self.worker_init_fn = worker_init_fn
        self.worker_reset_fn = worker_reset_fn
        self.batching = check_type("batching", batching, BatchingOptions)
        self.restore_options = RestoreOptions(verify_replay, max_items_between_captures, stateful)
        if stateful and not getattr(installed().worker_loop, "CAPTURES_STATES", False):
            module = FEATURES["worker_loop"][0][0]
            raise ValueError(f"stateful=True needs {module}, which this installation lacks")
        self.fault_options = FaultOptions(control_timeout_s, timeout_s, restart_dead_workers)
        if self.fault_options.restart_dead_workers:
            require("replacer", "restart_dead_workers")
        self.isolate_rng = bool(isolate_rng)
        self.read_ahead = check_type("read_ahead", read_ahead, bool)
        self.elastic = bool(elastic)
        if self.elastic:
            require("elastic_start", "elastic=True")
        if tensor_pool is not None:
            check_type("tensor_pool", tensor_pool, bool)
        self.tensor_pool = tensor_pool
        if tensor_pool:
            uses_tensor_pool(tensor_pool)  # raises where it cannot be
        TensorPoolOptions(1, tensor_pool_slot_bytes)  # validates it
        self.tensor_pool_slot_bytes = tensor_pool_slot_bytes
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        """Everything that only exists between ``initialize`` and ``finalize``."""
        self._session: Optional[Session] = None
        # The last DataPipe of the graph as adapted (the base class's name; code that introspects the
        # adapted graph, test_mprs.py among it, looks there): the outlet's source.
        self._end_datapipe: Optional[DataPipe] = None
        self._finalized = False

    # DataLoader2 requires a reading service to be picklable before `initialize` (DataLoader2
    # clones it); the processes and pipes that exist afterwards are never pickled.
    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if not key.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # --- ReadingServiceInterface --------------------------------------------------------------

    def initialize(self, datapipe: DataPipe) -> DataPipe:
        return self._initialize(datapipe)

    def _initialize(self, datapipe: DataPipe, plan: Any = None) -> DataPipe:
        """``initialize``, or a restore's start when ``plan`` (validated first) says what it resumes."""
        self._check_open()
        if self._session is not None:
            raise ReadingServiceError("initialize() was already called on this reading service")
        worker = WorkerOptions(self.worker_init_fn, self.worker_reset_fn, self.batching, self.restore_options)
        pool = self.tensor_pool_slot_bytes if uses_tensor_pool(self.tensor_pool) else None
        options = RuntimeOptions(
            num_workers=self.num_workers,
            multiprocessing_context=self.multiprocessing_context,
            prefetch=(self.worker_prefetch_cnt, self.main_prefetch_cnt),
            worker=worker,
            faults=self.fault_options,
            isolate_rng=self.isolate_rng,
            read_ahead=self.read_ahead,
            tensor_pool_slot_bytes=pool,
        )
        self._session = _session_class().open(datapipe, options, plan)
        self._end_datapipe = self._session.runtime.end
        return self._session.outlet

    def _broken(self) -> bool:
        return self._session is not None and self._session.broken

    @shut_down_when_broken
    def initialize_iteration(
        self, seed_generator: SeedGenerator, iter_reset_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        self._running("initialize_iteration()").start_epoch(seed_generator, iter_reset_fn)
        return None

    def finalize_iteration(self) -> None:
        pass

    def finalize(self) -> None:
        """Stop every process and release the pipes. Idempotent, bounded: healthy processes get
        ``min(JOIN_TIMEOUT_S, control_timeout_s)`` to exit; after a failure (a dead or stuck
        process, an interrupted exchange) the survivors are killed at once."""
        if getattr(self, "_finalized", True):
            return
        self._finalized = True
        if self._session is not None:
            # After a failure the iterator keeps naming it; after a plain shutdown, the shutdown.
            self._session.outlet.closed = not self._session.broken
            self._session.runtime.shutdown(min(JOIN_TIMEOUT_S, self.fault_options.control_timeout_s))

    # --- checkpoint / restore -------------------------------------------------------------------

    def checkpoint(self) -> Optional[Dict[str, Any]]:  # type: ignore[override, unused-ignore]  # plain data, not bytes
        """The state ``DataLoader2.state_dict()`` stores: versioned plain data (see
        :mod:`torchdata_snapshot.checkpoint.format`) describing what the *user* received: the epoch,
        its seeds, per worker how many of its items reached the user. Taking it does not talk to
        the workers, pause anything or change the data; its size does not grow with the position.
        (Without the checkpoint's module, ``None``: a restored loader starts its epoch over.)
        """
        self._check_open()
        if self._session is None:
            return _session_class().before_start(self.num_workers)
        return self._session.checkpoint()

    def restore(self, datapipe: DataPipe, serialized_state: Any) -> DataPipe:
        """Start the service for ``datapipe`` so that its next epoch resumes ``serialized_state``.

        The state is validated before any process starts (``InvalidCheckpointError``,
        ``IncompatibleCheckpointError``). A ``FileLister`` root that is another path in
        ``datapipe`` than in the state is a data directory that moved: the files the state reads
        again must be the same there (else ``ChangedFileError``), and it resumes there (see
        ``graph_state.moved_roots``). The epoch restarts with its recorded seeds and each
        worker replays the items the user already received (from its latest captured graph
        state, if any). With ``elastic=True``, a state taken with another ``num_workers`` or world
        size restarts the epoch over the elements the user had not received (see the checkpointing docs).
        """
        self._check_open()
        return self._initialize(datapipe, self._plan(datapipe, serialized_state))

    def _plan(self, datapipe: DataPipe, serialized_state: Any) -> Any:
        """What restoring ``serialized_state`` for ``datapipe`` resumes, validated; nothing starts
        (the session's :meth:`~torchdata_snapshot.core.session.Session.plan`)."""
        return _session_class().plan(datapipe, serialized_state, self.num_workers, self.elastic)

    # --- pause / resume / limit (DataLoader2's semantics) ------------------------------------------

    @shut_down_when_broken
    def _pause(
        self, pause_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        self._running("_pause()").pause(pause_fn)
        return None

    @shut_down_when_broken
    def _resume(
        self, resume_fn: Optional[Callable[[DataPipe], DataPipe]] = None
    ) -> Optional[Callable[[DataPipe], DataPipe]]:
        self._running("_resume()").resume(resume_fn)
        return None

    @shut_down_when_broken
    def _limit(
        self,
        num_batches: Optional[int],
        limit_fn: Optional[Callable[[DataPipe, Optional[int]], DataPipe]] = None,
    ) -> Optional[Callable[[DataPipe, Optional[int]], DataPipe]]:
        if limit_fn is not None:
            self._running("_limit()").limit(num_batches, limit_fn)
        return None

    def _check_open(self) -> None:
        if self._finalized:
            raise ReadingServiceClosedError(
                "the reading service was shut down (DataLoader2.shutdown() or finalize()), and its "
                "workers with it: create a new one"
            )

    def _running(self, what: str) -> Session:
        """The session, for ``what`` (a method's name) to use; raises
        :class:`ReadingServiceClosedError` after ``finalize()`` and :class:`ReadingServiceError`
        before ``initialize()``."""
        self._check_open()
        if self._session is None:
            raise ReadingServiceError(
                f"{what} needs a running reading service: create an iterator of the DataLoader2 first"
            )
        return self._session

    # --- the RFC: snapshot --------------------------------------------------------------------

    @shut_down_when_broken
    def snapshot(self) -> List[WorkerSnapshot]:
        """One :class:`WorkerSnapshot` per worker, taken at one consistent point.

        Main-process DataPipes with their own threads are paused, every worker answers a
        ``GetStateRequest`` between two items, and the items the workers sent before answering
        are read into the main process's buffer, so that the counts add up (see
        :class:`WorkerSnapshot`). Nothing about the order of the data changes.
        With ``num_workers=0`` the single snapshot describes the in-process graph.
        """
        return self._running("snapshot()").snapshot()

    def __repr__(self) -> str:
        names = ("num_workers", "multiprocessing_context", "worker_prefetch_cnt", "main_prefetch_cnt")
        return f"{type(self).__name__}({', '.join(f'{name}={getattr(self, name)!r}' for name in names)})"
