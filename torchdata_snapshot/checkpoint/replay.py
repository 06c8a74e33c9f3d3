"""Restore by deterministic replay: produce and drop the items a user already received, checking
that they are the same ones.

A worker replays its stream inside its own process; the outlet replays the whole epoch in the
main process when positions in the workers' streams cannot be told apart (``num_workers=0``, a
main-process tail that batches or filters). Both go through :func:`replay`, which folds every
replayed item into the stream's running digest (:mod:`torchdata_snapshot.checkpoint.digest`) and compares
the result with the one the checkpoint recorded.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torchdata_snapshot._errors import ReplayDivergenceError
from torchdata_snapshot.checkpoint.digest import chain, chain_hex

__all__ = ["replay"]


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
) -> Optional[int]:
    """Produce and drop items ``start + 1 .. start + count`` of a stream from ``iterator``.

    ``digest`` is the stream's running digest after item ``start`` (``None``: not kept); the one
    after the last replayed item is returned, and must equal ``expected`` (when both are known),
    or :class:`~torchdata_snapshot.ReplayDivergenceError` is raised: continuing would hand out
    other data. So is a stream that ends before ``start + count``. ``on_item(position)`` is called
    after each item (a worker reports progress). ``where`` and ``epoch`` name the stream.
    """
    for position in range(start + 1, start + count + 1):
        try:
            item = next(iterator)
        except StopIteration:
            raise ReplayDivergenceError(
                f"{where}: the replayed stream of epoch {epoch} ended after {position - 1} items, but the "
                f"checkpoint says the user had received {start + count} of them: the pipeline is not "
                "deterministic"
            ) from None
        if digest is not None:
            digest = chain(digest, item)
        if on_item is not None:
            on_item(position)
    if count and digest is not None and expected is not None and chain_hex(digest) != expected:
        raise ReplayDivergenceError(
            f"{where}: items {start + 1}..{start + count} of epoch {epoch} replayed differently from those "
            f"the user received before the checkpoint (running digest {chain_hex(digest)}, recorded "
            f"{expected}): the pipeline is not deterministic (a file changed? an unseeded random "
            "source?); pass verify_replay=False to continue anyway"
        )
    return digest
