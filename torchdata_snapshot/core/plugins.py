"""The optional features the core can use, through small typed interfaces the core owns.

Self-healing (``healing/``), elastic resume (``elastic/``) and the tensor pool (``tensor_pool/``)
are folders of their own: the core and the checkpoint import none of them. The core asks
:func:`installed` for a feature where it plugs in, and finds it by its module's name (``FEATURES``),
imported the first time it is asked for. Without a feature's folder the package works as it does
with the feature's option off; asking for the option raises ``ValueError`` naming the missing
folder (see the docs' design page).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Protocol, Tuple

if TYPE_CHECKING:
    from torchdata_snapshot._errors import WorkerDiedError
    from torchdata_snapshot.core.main.worker_record import WorkerStream
    from torchdata_snapshot.core.messages import ResetEpochRequest
    from torchdata_snapshot.core.transport.channel import Channel

__all__ = ["FEATURES", "Plugins", "Replacer", "ReplacerFactory", "installed", "require"]


class Replacer(Protocol):
    """Self-healing: gives a worker that died a new process, brought to where the dead one was."""

    def replace(
        self,
        stream: WorkerStream,
        death: WorkerDiedError,
        epoch: int,
        reset: ResetEpochRequest,
        paused: bool,
    ) -> None: ...


#: ``(respawn, restarts_allowed, control_timeout_s) -> Replacer``; ``respawn(worker_id)`` starts a
#: new process for a worker and returns its channel.
ReplacerFactory = Callable[[Callable[[int], "Channel"], int, float], Replacer]


@dataclass(frozen=True)
class Plugins:
    """What the installed features offer; ``None`` where a feature's folder is not there."""

    #: ``healing/``: replaces dead workers (``restart_dead_workers``).
    replacer: Optional[ReplacerFactory] = None


#: Each field of ``Plugins``: the module that offers it and the name it has there.
FEATURES: Dict[str, Tuple[str, str]] = {
    "replacer": ("torchdata_snapshot.healing.replacer", "WorkerReplacer"),
}


@functools.cache
def installed() -> Plugins:
    """The features whose modules are there, imported the first time this is called."""
    found: Dict[str, Any] = {}
    for field, (module, name) in FEATURES.items():
        try:
            there = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the feature's folder is gone
            there = False
        if there:
            found[field] = getattr(importlib.import_module(module), name)
    return Plugins(**found)


def require(feature: str, option: str) -> Any:
    """The installed ``feature`` (a field of ``Plugins``), or ``ValueError`` saying that ``option``
    needs the module this installation lacks."""
    found = getattr(installed(), feature)
    if found is None:
        module = FEATURES[feature][0].rsplit(".", 1)[0]
        raise ValueError(f"{option} needs {module}, which this installation of torchdata_snapshot lacks")
    return found
