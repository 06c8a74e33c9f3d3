"""``load_state_dict(dataloader, state)``: resume a DataLoader2 state with the pipeline the code
builds now, checked against it before any worker starts (``DataLoader2.load_state_dict`` and
``from_state`` restore the pipeline pickled in the state)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from torchdata_snapshot._compat.dataloader2 import (
    dataloader2_reading_service_state,
    dataloader2_started,
    load_dataloader2_state,
)
from torchdata_snapshot._errors import InvalidCheckpointError, ReadingServiceError
from torchdata_snapshot.core.reading_service import MultiProcessingReadingService

if TYPE_CHECKING:
    from torchdata.dataloader2 import DataLoader2

__all__ = ["load_state_dict"]


def load_state_dict(dataloader: DataLoader2, state: Dict[str, Any]) -> None:
    """Load ``state`` (what ``DataLoader2.state_dict()`` returned, through ``torch.save``/
    ``torch.load`` or ``pickle`` too) into ``dataloader``, *keeping the datapipe it was built
    with*: its next ``iter()`` continues where the user of ``state`` stopped.

    ``DataLoader2.load_state_dict(state)`` and ``DataLoader2.from_state(state, ...)`` restore the
    pipeline pickled in ``state`` instead, whatever the code builds now: a batch size changed
    since, or the new path of a data directory that moved, never reaches them. Here ``state``
    gives the positions, the seeds and the reading service's state only, checked against
    ``dataloader``'s pipeline now, before any worker starts: another structure or an argument
    that changes the data (``batch(8)`` for ``batch(4)``) raises
    :class:`~torchdata_snapshot.IncompatibleCheckpointError` naming the DataPipe and the argument;
    a ``FileLister`` root that is another path is a data directory that moved, which resumes
    there when the files the restore reads again are the same (their names below the root, sizes
    and modification times), and raises :class:`~torchdata_snapshot.ChangedFileError` naming each
    one that is not. Under ``SequentialReadingService`` the checks wait for the first ``iter()``
    (the sharding its other services apply is part of them); they still come before any worker.

    ``state_dict()`` returns ``state`` until the next ``iter()``, as after torchdata's calls.

    Args:
        dataloader: a ``DataLoader2`` not iterated yet, built with the pipeline to resume and a
            :class:`MultiProcessingReadingService` (or a ``SequentialReadingService`` holding one).
        state: what ``DataLoader2.state_dict()`` returned when the checkpoint was taken.
    """
    # Imported here: in torchdata's tree this module loads while dataloader2.py is being imported.
    from torchdata.dataloader2 import DataLoader2

    if not isinstance(dataloader, DataLoader2):
        raise TypeError(f"load_state_dict() loads into a DataLoader2, not a {type(dataloader).__name__}")
    if dataloader2_started(dataloader):
        raise ReadingServiceError(
            "load_state_dict() must come before the DataLoader2 is first iterated or shut down: create "
            "a new DataLoader2 and load the state into it"
        )
    if dataloader.datapipe is None:
        raise ValueError(
            "this DataLoader2 was built without a datapipe: build it with the pipeline to resume, or "
            "restore the one pickled in the state with DataLoader2.from_state(state, reading_service)"
        )
    try:
        service_state = dataloader2_reading_service_state(state) if isinstance(state, dict) else None
    except KeyError as e:
        raise InvalidCheckpointError(f"not a DataLoader2 state: the dict has no {e} entry") from e
    if service_state is None:
        raise InvalidCheckpointError(
            "not a DataLoader2 state with a reading service's: load what DataLoader2.state_dict() of a "
            f"loader with a MultiProcessingReadingService returned, not a {type(state).__name__}"
            + (" without one" if isinstance(state, dict) else "")
        )
    service = dataloader.reading_service
    if isinstance(service, MultiProcessingReadingService):
        plan = service._plan(dataloader.datapipe, service_state)  # refusals now, at this call
        if plan.moved:
            service_state = plan.state.to_plain()
    elif not any(
        isinstance(rs, MultiProcessingReadingService) for rs in getattr(service, "reading_services", ())
    ):
        raise TypeError(
            "load_state_dict() restores into torchdata_snapshot.MultiProcessingReadingService (or a "
            f"SequentialReadingService holding one), and this DataLoader2 has {service!r}"
        )
    load_dataloader2_state(dataloader, service_state, state)
