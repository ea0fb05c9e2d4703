"""Jumping a virtual clock to the next moment something can run (``run_until_idle``).

Shared by the thread and the asyncio runtimes: both hold delayed retries with their
due time (broker clock) and, when nothing is active, ask this one question.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from msgpatterns.brokers.base import SupportsVirtualTime

__all__ = ["jump_to_next_due"]


def jump_to_next_due(broker: Any, topics: Sequence[str], group: str,
                     held: Mapping[Any, float], *, can_fetch: bool) -> bool | None:
    """Move ``broker``'s virtual clock to the next due moment: the earliest held retry
    or - when a slot is free to fetch it (``can_fetch``) - the broker's next due
    delivery. Returns None when nothing could move, else whether a fetch may now find
    something (the broker's clock was consulted). Raises what the broker raises."""
    virtual = broker if isinstance(broker, SupportsVirtualTime) else None
    due: float | None = None
    if can_fetch and virtual is not None:
        due = virtual.next_due(topics, group)
    if held:
        first_hold = min(held.values())
        due = first_hold if due is None else min(due, first_hold)
    if due is None:
        return None
    if virtual is not None:
        virtual.advance_to(due)
    return can_fetch and virtual is not None
