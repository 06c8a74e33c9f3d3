"""Restore by deterministic replay: produce and drop the items a user already received, checking
that they are the same ones.

A worker replays its stream inside its own process; the outlet replays the whole epoch in the
main process when positions in the workers' streams cannot be told apart (``num_workers=0``, a
main-process tail that batches or filters). Both go through :func:`replay`, which folds every
replayed item into the stream's running digest (:mod:`torchdata_snapshot.checkpoint.digest`) and compares
the result with the one the checkpoint recorded.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence

from torchdata_snapshot._constants import REPLAY_PROGRESS_LOG_S
from torchdata_snapshot._errors import ReplayDivergenceError
from torchdata_snapshot.checkpoint.digest import chain, chain_hex
from torchdata_snapshot.core.graph import describe_datapipe

__all__ = ["ReplayProgressLog", "divergence_causes", "own_stateful", "replay"]

logger = logging.getLogger(__name__)


class ReplayProgressLog:
    """Logs a long replay's progress at INFO, throttled by time: the first record ``interval_s``
    (default ``REPLAY_PROGRESS_LOG_S``) after :meth:`start`, then at most one per ``interval_s``
    however many streams report, so that a replay of minutes says it is alive and one of
    seconds says nothing until its result."""

    def __init__(
        self, interval_s: Optional[float] = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = REPLAY_PROGRESS_LOG_S if interval_s is None else interval_s
        self.clock = clock
        self.start()

    def start(self) -> None:
        """A replay starts now."""
        self.started = self.clock()
        self.due = self.started + self.interval_s

    def report(self, where: str, epoch: int, position: int, target: int) -> None:
        """``where``'s replay of ``epoch`` has reached item ``position`` of ``target``."""
        now = self.clock()
        if now < self.due:
            return
        self.due = now + self.interval_s
        logger.info(
            "%s: replaying epoch %d, at item %d of %d (%.0f s so far)",
            where,
            epoch,
            position,
            target,
            now - self.started,
        )


def own_stateful(datapipes: Iterable[Any]) -> List[str]:
    """The DataPipes of ``datapipes`` whose class, of the user's own, restores a state
    (``load_state_dict``): named among the causes of a divergence, since one that resets what it
    loaded in its next ``__iter__`` replays other items."""
    own = [
        dp
        for dp in datapipes
        if callable(getattr(type(dp), "load_state_dict", None))
        and not type(dp).__module__.startswith(("torch.", "torchdata.", "torchdata_snapshot."))
    ]
    return [describe_datapipe(dp) for dp in own]


def divergence_causes(stateful: Sequence[str] = ()) -> str:
    """What usually makes a pipeline replay other items, the cause this process can see first
    (``hash()`` of ``str`` and ``bytes`` is salted per process unless ``PYTHONHASHSEED`` fixes
    it; ``stateful``: DataPipes of the user's own that restore a state, see :func:`own_stateful`),
    and what ``verify_replay=False`` would cost."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        hashing = (
            "PYTHONHASHSEED is not set, so hash() of a str or bytes differs from one process to the "
            "next: a tokenizer, a bucketing or a sampling that uses hash() does not replay (set "
            "PYTHONHASHSEED to one value, such as 0, for every run, the one that saves included)"
        )
    else:
        hashing = (
            f"hash() of a str or bytes is fixed here (PYTHONHASHSEED={seed}): it was the same in the run "
            "that saved only if that run had the same PYTHONHASHSEED"
        )
    own = (
        f"; a DataPipe of your own that restores a state ({', '.join(stateful)}) but does not continue, at "
        "its next __iter__, from the state load_state_dict() loaded (one that resets its counters in "
        "__iter__; see docs/contract.rst, 'DataPipes of your own')"
        if stateful
        else ""
    )
    return (
        f"Usual causes: {hashing}{own}; an unseeded source of randomness (random.Random() or "
        "numpy.random.default_rng() without a seed, os.urandom, uuid.uuid4, the time); a file read "
        "that changed since the checkpoint; items that hold the paths of a data directory that "
        "moved since; an order that is not fixed (of a set, of os.listdir). "
        "Remove the cause and restore again: verify_replay=False only turns this check off, and the "
        "restore then hands out whatever the pipeline produces now, which is other data than the "
        "interrupted run's"
    )


def replay(
    iterator: Iterator[Any],
    start: int,
    count: int,
    digest: Optional[int],
    expected: Optional[str],
    *,
    where: str,
    epoch: int,
    on_item: Optional[Callable[[int], None]] = None,
    stateful: Sequence[str] = (),
) -> Optional[int]:
    """Produce and drop items ``start + 1 .. start + count`` of a stream from ``iterator``.

    ``digest`` is the stream's running digest after item ``start`` (``None``: not kept); the one
    after the last replayed item is returned, and must equal ``expected`` (when both are known),
    or :class:`~torchdata_snapshot.ReplayDivergenceError` is raised: continuing would hand out
    other data. So is a stream that ends before ``start + count``. ``on_item(position)`` is called
    after each item (a worker reports progress). ``where`` and ``epoch`` name the stream;
    ``stateful`` the DataPipes of the user's own that restore a state (:func:`own_stateful`).
    """
    for position in range(start + 1, start + count + 1):
        try:
            item = next(iterator)
        except StopIteration:
            raise ReplayDivergenceError(
                f"{where}: the replayed stream of epoch {epoch} ended after {position - 1} items, but the "
                f"checkpoint says the user had received {start + count} of them: the pipeline is not "
                f"deterministic for its seeds. {divergence_causes(stateful)}"
            ) from None
        if digest is not None:
            digest = chain(digest, item)
        if on_item is not None:
            on_item(position)
    if count and digest is not None and expected is not None and chain_hex(digest) != expected:
        raise ReplayDivergenceError(
            f"{where}: items {start + 1}..{start + count} of epoch {epoch} replayed differently from those "
            f"the user received before the checkpoint (running digest {chain_hex(digest)}, recorded "
            f"{expected}): the pipeline is not deterministic for its seeds. {divergence_causes(stateful)}"
        )
    return digest
