"""The claim-round scenarios' face of the two drivers (:mod:`two_drivers`), so that a
scenario is written once and runs on ``Consumer`` and ``AsyncConsumer``.

A scenario writes its handler's *body* once (see :mod:`two_drivers`: it does its work
and ``yield``\\ s its waits, :class:`Sleep` or :class:`Until`). The handler is
``@idempotent`` on the checker the driver built for a store: a
:class:`~msgpatterns.idempotency.MemoryChecker` for both, or a real Redis
(:class:`~msgpatterns.idempotency.RedisChecker` / ``AsyncRedisChecker``, a namespace of
its own, deleted afterwards). ``per_message=True`` wraps the decorated handler in a
plain function: the runtime then sees no ``@idempotent`` handler and every message
claims and completes its own key (the plain twin of batch claims - how
``docs/idempotency.md`` says to opt out of them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from msgpatterns import InMemoryBroker
from two_drivers import AsyncDriver as AsyncBase
from two_drivers import Body, Running, Sleep, Until, publish
from two_drivers import Driver as Base
from two_drivers import SyncDriver as SyncBase

__all__ = ["GROUP", "STORES", "AsyncDriver", "Driver", "Sleep", "SyncDriver", "Until",
           "driver", "publish"]

GROUP = "claims.handle"
#: The stores a scenario runs on (Redis is the real server, with its marker).
STORES = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


class Driver:
    """How a scenario builds its checker and its consumer on one driver."""

    def __init__(self, base: Base) -> None:
        self.base = base
        self.name = base.name

    def __repr__(self) -> str:
        return self.name

    @contextmanager
    def checker(self, store: str, **options: Any) -> Iterator[Any]:
        """The driver's checker on ``store`` (``memory`` or ``redis``)."""
        with self.base.checker(store, **options) as checker:
            yield checker

    def consumer(self, broker: InMemoryBroker, body: Body, checker: Any, *,
                 workers: int = 4, per_message: bool = False,
                 **options: Any) -> Running:
        """A consumer of topic ``orders`` (group ``billing``) whose ``@idempotent``
        handler runs ``body``; ``workers`` are the sync driver's threads (the async
        driver runs up to ``max_in_flight`` at once)."""
        handle = self.base.idempotent(checker, body, group=GROUP)
        return self.base.consumer(broker, self.base.plain(handle) if per_message else handle,
                                  topics=["orders"], group="billing", workers=workers,
                                  **options)

    def close(self) -> None:
        self.base.shutdown()


class SyncDriver(Driver):
    def __init__(self) -> None:
        super().__init__(SyncBase())


class AsyncDriver(Driver):
    def __init__(self) -> None:
        super().__init__(AsyncBase())


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Iterator[Driver]:
    """Each driver in turn (the async one with a loop thread of its own)."""
    made: Driver = SyncDriver() if request.param == "sync" else AsyncDriver()
    try:
        yield made
    finally:
        made.close()

