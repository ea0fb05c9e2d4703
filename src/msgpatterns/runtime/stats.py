"""What a consumer did so far (both drivers count the same fields), and the report
of it to a telemetry listener."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs

__all__ = ["ConsumerStats", "Reporter"]


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


class Reporter:
    """Reports counts and settlements of ``owner`` (a consumer) to the installed
    telemetry listener (:mod:`msgpatterns.observability.stats`); no cost without one."""

    __slots__ = ("owner",)

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def count(self, counts: Mapping[str, int], message: Message | None = None) -> None:
        """``counts`` (ConsumerStats fields) were just added to."""
        listener = _obs.listener
        if listener is not None:
            _obs.report(listener.consumer_counted, self.owner, counts, message)

    def settled(self, message: Message, counted: list[str],
                error: BaseException | None) -> None:
        """``message`` was settled with ``error`` and counted as ``counted``."""
        listener = _obs.listener
        if listener is not None:
            _obs.report(listener.delivery_settled, self.owner, message, counted, error)
