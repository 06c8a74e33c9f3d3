"""The state functions of DataPipe types that have no state methods of their own.

:func:`~torchdata_snapshot.register_state_functions` records them on the class itself, as elastic
resume's ``register_elastic`` records its declaration, not in a table of this module. A worker
started by ``spawn`` or ``forkserver`` imports the class anew but does not run the code that
registered them (a script's ``main()``): the main process sends each worker those of its graph's
types (:func:`graph_state_functions`), checked to pickle (:func:`check_state_functions_pickle`),
and the worker's ``GraphState`` uses them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._errors import StateCaptureError
from torchdata_snapshot.core.graph import graph_datapipes

__all__ = [
    "StateFunctions",
    "check_state_functions_pickle",
    "graph_state_functions",
    "register_state_functions",
    "registered_state_functions",
]


#: The class attribute in which :func:`register_state_functions` records the functions: a
#: :class:`StateFunctions` naming the class it was made for, so that a subclass, which inherits
#: the attribute, is not taken as registered.
_REGISTERED = "_dataloader2_state_functions"


@dataclass(frozen=True)
class StateFunctions:
    """The functions :func:`register_state_functions` recorded for DataPipes of exactly
    ``datapipe_type``."""

    datapipe_type: type
    state_dict: Callable[[Any], Any]
    load_state_dict: Callable[[Any, Any], None]


def register_state_functions(
    datapipe_type: type, state_dict: Callable[[Any], Any], load_state_dict: Callable[[Any, Any], None]
) -> None:
    """Make DataPipes of ``datapipe_type`` resumable without changing the class.

    ``state_dict(dp)`` returns a picklable state at a yield point; ``load_state_dict(dp, state)``
    prepares ``dp`` so that its next iteration continues from that state. The registration
    covers the class, not its subclasses.

    The registrations of the graph's DataPipe types are sent to the worker processes when they
    start, also under ``spawn`` and ``forkserver``, whose workers do not run the code that made
    them (a script's ``main()``). There the functions travel pickled, by reference: they must be
    defined at module level (a lambda or a nested function is refused with
    :class:`~torchdata_snapshot.StateCaptureError` when the workers start).

    Args:
        datapipe_type: the DataPipe class (exactly this one, not its subclasses).
        state_dict: ``state_dict(dp)``, the picklable state of ``dp`` at a yield point.
        load_state_dict: ``load_state_dict(dp, state)``, prepares ``dp`` to continue from ``state``.
    """
    setattr(datapipe_type, _REGISTERED, StateFunctions(datapipe_type, state_dict, load_state_dict))


def registered_state_functions(datapipe_type: type) -> Optional[StateFunctions]:
    """What :func:`register_state_functions` recorded in this process for exactly ``datapipe_type``."""
    found = getattr(datapipe_type, _REGISTERED, None)
    return found if isinstance(found, StateFunctions) and found.datapipe_type is datapipe_type else None


def graph_state_functions(datapipe: DataPipe) -> Tuple[StateFunctions, ...]:
    """The registered state functions of the graph's DataPipe types, for the worker processes
    that run it (their ``GraphState``)."""
    kinds = dict.fromkeys(type(dp) for _, dp in graph_datapipes(datapipe))
    found = (registered_state_functions(kind) for kind in kinds)
    return tuple(functions for functions in found if functions is not None)


def check_state_functions_pickle(carried: Sequence[StateFunctions], start_method: str) -> None:
    """Raise :class:`StateCaptureError` naming a DataPipe type whose state function does not
    pickle: workers started by ``start_method`` could not receive it."""
    for functions in carried:
        for function in (functions.state_dict, functions.load_state_dict):
            try:
                pickle.dumps(function, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                kind = functions.datapipe_type
                raise StateCaptureError(
                    f"the state function {function!r} registered for {kind.__module__}.{kind.__qualname__} "
                    f"cannot be sent to worker processes started by {start_method!r} "
                    f"({type(e).__name__}: {e}): define it at module level, or use "
                    "multiprocessing_context='fork'"
                ) from e
