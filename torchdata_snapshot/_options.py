"""Options of the reading service that are plain values (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchingOptions"]


@dataclass(frozen=True)
class BatchingOptions:
    """How items are grouped into messages.

    A worker hands every item to its outbox thread as soon as it is produced; the thread sends
    whatever has accumulated as one message, of at most ``max_items`` items, closed once it
    holds ``max_bytes`` pickled bytes. Slow items therefore go out one by one and tiny items in
    batches, and no item waits for the next one. The dispatching process, which has no outbox
    thread, also sends what it produced after at most ``max_delay_s`` of producing.
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
