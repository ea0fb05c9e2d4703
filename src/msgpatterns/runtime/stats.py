"""What a consumer did so far (both drivers count the same fields)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

__all__ = ["ConsumerStats"]


@dataclass
class ConsumerStats:
    """What the consumer did so far."""

    fetched: int = 0
    acked: int = 0
    failed: int = 0
    retried_locally: int = 0
    redelivered: int = 0
    dead_lettered: int = 0
    ack_timeouts: int = 0
    released: int = 0
    broker_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def add(self, counted: Iterable[str]) -> None:
        """Add one to each named field (the caller serialises)."""
        for name in counted:
            setattr(self, name, getattr(self, name) + 1)
