"""What the core can use beyond itself, through small typed interfaces the core owns.

The core streams a graph's items and answers ``snapshot()``; checkpoints and restores extend it
from above: the checkpoint (restores by replay) and the graph's captured states (restores
without replay) each offer a worker loop and a session that extend the core's, and the core
runs the most capable one installed. Self-healing, elastic resume and the tensor pool are
optional features, modules of their own that the core and the checkpoint never import. The
core asks :func:`installed` for what plugs in where it needs it, and finds each by its module's
name (``FEATURES``), imported the first time it is asked for. Without a feature's module the
package works as it does with the feature's option off; asking for the option raises
``ValueError`` naming the missing module (see the docs' design page).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Protocol, Tuple

if TYPE_CHECKING:
    from torchdata_snapshot.core.messages import ItemsResponse, Response
    from torchdata_snapshot.core.options import TensorPoolOptions
    from torchdata_snapshot.core.transport.item_codec import ItemPool

__all__ = [
    "FEATURES",
    "Plugins",
    "ProgressLog",
    "StreamLog",
    "TensorPoolFeature",
    "installed",
    "own_process_start",
    "require",
    "uses_tensor_pool",
    "starting_own_process",
]


class StreamLog(Protocol):
    """What a checkpoint keeps of one worker's stream in the main process, beside the core's
    counts (:class:`~torchdata_snapshot.core.main.worker_record.WorkerRecord`): enough to bring a
    fresh worker to a position of the stream."""

    def start(self, position: Any) -> None:
        """The epoch starts at ``position`` (``None``: its beginning; else the log's own record)."""

    def filed(self, first: int, response: ItemsResponse) -> None:
        """The items of ``response`` were received, the first of them at position ``first``."""

    def file(self, response: Response, epoch: int) -> bool:
        """Keep ``response`` if it is the log's (``False``: it is not)."""

    def prune(self, kept: int) -> None:
        """Positions before ``kept`` will not be asked for any more."""


class ProgressLog(Protocol):
    """Says how a long replay progresses (the checkpoint's log)."""

    def start(self) -> None: ...

    def report(self, where: str, epoch: int, position: int, target: int) -> None: ...


class TensorPoolFeature(Protocol):
    """The tensor pool: makes a worker's :class:`ItemPool` in the main process before the worker
    starts, and says why this platform cannot have one (``None``: it can)."""

    def __call__(self, options: TensorPoolOptions) -> ItemPool: ...

    def unavailable(self) -> Optional[str]: ...


@dataclass(frozen=True)
class Plugins:
    """What the installed modules offer; ``None`` where a module is not there. Each interface is
    owned by the layer a field plugs into, and named in the field's comment."""

    #: Self-healing: replaces dead workers (``restart_dead_workers``): a
    #: :data:`~torchdata_snapshot.core.main.links.ReplacerFactory`.
    replacer: Optional[Any] = None
    #: Elastic resume, in restore planning (``elastic=True``): an
    #: :data:`~torchdata_snapshot.checkpoint.restore_plan.ElasticStart`.
    elastic_start: Optional[Any] = None
    #: Elastic resume, in a worker: makes each worker's
    #: :class:`~torchdata_snapshot.graph_state.worker_loop.ElasticWorker`.
    elastic_worker: Optional[Callable[[], Any]] = None
    #: The tensor pool: a worker's pool of shared-memory slots for the tensors of its items
    #: (``tensor_pool``: on by default where the platform has it), made in the main process
    #: before the worker starts.
    tensor_pool: Optional[TensorPoolFeature] = None
    #: Checkpoints: the worker loop that also restores, by replay and from captured graph states
    #: (a subclass of the core's :class:`~torchdata_snapshot.core.worker.loop.WorkerLoop`, which
    #: only streams).
    worker_loop: Optional[type] = None
    #: Checkpoints: the session that also checkpoints and restores (a subclass of the core's
    #: :class:`~torchdata_snapshot.core.session.Session`, whose ``checkpoint()`` has nothing
    #: mid-epoch to say).
    session: Optional[type] = None


#: Each field of ``Plugins``: the modules that offer it and the name each has there, the most
#: capable first (the first one installed is used).
FEATURES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "replacer": (("torchdata_snapshot.healing.replacer", "WorkerReplacer"),),
    "elastic_start": (("torchdata_snapshot.elastic.planner", "elastic_start"),),
    "elastic_worker": (("torchdata_snapshot.elastic.worker", "ShardingProgress"),),
    "tensor_pool": (("torchdata_snapshot.tensor_pool.pool", "TensorPool"),),
    "worker_loop": (
        ("torchdata_snapshot.graph_state.worker_loop", "StatefulWorkerLoop"),
        ("torchdata_snapshot.checkpoint.worker_loop", "ReplayingWorkerLoop"),
    ),
    "session": (
        ("torchdata_snapshot.graph_state.session", "StatefulSession"),
        ("torchdata_snapshot.checkpoint.session", "CheckpointSession"),
    ),
}


def _is_there(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the module's folder is not there
        return False


@functools.cache
def installed() -> Plugins:
    """What the installed modules offer, imported the first time this is called."""
    found: Dict[str, Any] = {}
    for field, offers in FEATURES.items():
        for module, name in offers:
            if _is_there(module):
                found[field] = getattr(importlib.import_module(module), name)
                break
    return Plugins(**found)


def require(feature: str, option: str) -> Any:
    """The installed ``feature`` (a field of ``Plugins``), or ``ValueError`` saying that ``option``
    needs the module this installation lacks (named in full: it is the same module wherever the
    package's modules are placed; the least capable one that offers it)."""
    found = getattr(installed(), feature)
    if found is None:
        raise ValueError(f"{option} needs {FEATURES[feature][-1][0]}, which this installation lacks")
    return found


def uses_tensor_pool(option: Optional[bool]) -> bool:
    """Whether workers get a tensor pool: ``option`` ``None`` (the default) where the feature is
    installed and the platform has it, ``True`` always (else ``ValueError`` naming what is
    missing: the module, or the platform), ``False`` never."""
    if option is False:
        return False
    feature = installed().tensor_pool
    if feature is None:
        if option:
            require("tensor_pool", "tensor_pool=True")  # raises, naming the module
        return False
    reason = feature.unavailable()
    if reason is not None:
        if option:
            raise ValueError(f"tensor_pool=True: {reason}")
        return False
    return True


# --- what the core tells the features --------------------------------------------------------------

#: Per thread: whether it is starting a process of the reading service's own.
_own_starts = threading.local()


@contextlib.contextmanager
def own_process_start() -> Iterator[None]:
    """Around ``Process.start()`` of a process the reading service starts (a worker, the
    dispatching process). A feature that watches this process's forks (the tensor pool's lent
    slots) tells such a fork from the user's with
    :func:`starting_own_process`: the reading service's processes read none of the user's items."""
    _own_starts.active = True
    try:
        yield
    finally:
        _own_starts.active = False


def starting_own_process() -> bool:
    """Whether this thread is inside :func:`own_process_start`."""
    return getattr(_own_starts, "active", False)
