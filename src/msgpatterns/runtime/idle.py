"""The idle driver of ``run_until_idle``: when nothing can run, move virtual time.

It is asked only when every held message is parked or waiting for a retry (nothing
active could change what becomes due). On a virtual clock it jumps to the next due
moment - the earliest waiting retry or, with a free slot, the broker's next due
delivery - and hands back the retries now due; on a real clock the retries fire by
themselves and only the broker's clock may be moved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from msgpatterns.brokers.virtual_time import jump_to_next_due
from msgpatterns.message import Message
from msgpatterns.runtime.scheduler import RetryScheduler
from msgpatterns.runtime.stats import ConsumerStats

__all__ = ["jump", "jump_or_none"]


def jump(broker: Any, topics: Sequence[str], group: str,
         scheduler: RetryScheduler[Message], *,
         can_fetch: bool) -> tuple[bool, list[Message]] | None:
    """Move time to the next moment something can run. None when nothing could move;
    else (whether a fetch may now find something, the retries now due). Raises what
    the broker raises."""
    waiting = scheduler.waiting() if scheduler.clock.virtual else {}
    fetchable = jump_to_next_due(broker, topics, group, waiting, can_fetch=can_fetch)
    if fetchable is None:
        return None
    return fetchable, scheduler.pop_due()


def jump_or_none(broker: Any, topics: Sequence[str], group: str,
                 scheduler: RetryScheduler[Message], *, can_fetch: bool,
                 stats: ConsumerStats, count: Callable[[Mapping[str, int]], object],
                 log: logging.Logger, name: str) -> tuple[bool, list[Message]] | None:
    """:func:`jump`; a broker that refuses (closed...) is counted, logged and answered
    with None: the driver waits instead of dying."""
    try:
        return jump(broker, topics, group, scheduler, can_fetch=can_fetch)
    except Exception:
        stats.broker_errors += 1
        count({"broker_errors": 1})
        log.exception("%s: moving virtual time failed", name)
        return None
