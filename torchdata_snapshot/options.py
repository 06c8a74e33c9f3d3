"""Options of the reading service that are plain values (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchingOptions"]


@dataclass(frozen=True)
class BatchingOptions:
    """How a worker groups items into one message.

    A batch is sent as soon as it holds ``max_items`` items or ``max_bytes`` pickled bytes, when
    credit runs out, or when producing one more item would hold the first one back longer than
    ``max_delay_s`` (estimated from the recent time per item). Slow items therefore go out one by
    one, tiny items in batches.
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
