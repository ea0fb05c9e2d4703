"""What every Redis Streams part (sync and async adapter, admin, raw loop) does with
redis-py: its exceptions as the library's own, a client from a URL, a consumer's own
pending deliveries, and the settings every adapter starts with."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from msgpatterns._extras import require
from msgpatterns.brokers import codec
from msgpatterns.brokers.redis._wire import CLAIM, PROMOTE, SETTLE
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
)
from msgpatterns.limits import check_max_message_bytes

redis = require("redis", "redis")

__all__ = [
    "AUTH_ERRORS",
    "CONNECTION_ERRORS",
    "NoGroup",
    "StreamsSettings",
    "client_from",
    "own_pending",
    "own_pending_async",
    "redis",
    "redis_error",
]

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)
AUTH_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthorizationError)


class NoGroup(BrokerError):
    """Redis answered NOGROUP: the consumer group (or its stream) is gone."""


def redis_error(exc: BaseException, where: str, closed: bool = False) -> BrokerError:
    """The library's error for redis-py's ``exc`` (which becomes its cause): refused
    credentials and unreachable servers are :class:`BrokerUnavailable` (a call cut by
    ``close()`` is :class:`BrokerClosed`), NOGROUP is the adapter's lost-group signal,
    anything else a :class:`BrokerError`."""
    if isinstance(exc, AUTH_ERRORS):
        return BrokerUnavailable(f"redis refused the credentials ({where}): {exc}")
    if isinstance(exc, CONNECTION_ERRORS):
        if closed:
            return BrokerClosed(f"{where} was closed during a redis call")
        return BrokerUnavailable(f"redis unreachable ({where}): {exc}")
    if isinstance(exc, redis.ResponseError):
        if "NOGROUP" in str(exc):  # also inside a script's error text
            return NoGroup(str(exc))
        return BrokerError(f"redis refused a command ({where}): {exc}")
    return BrokerError(f"redis call failed ({where}): {exc}")


def client_from(url: Any, factory: Any) -> tuple[Any, bool]:
    """The client for ``url`` (a URL: a new one from ``factory.from_url``, which the
    caller owns and closes; else ``url`` is a client already, shared) and whether the
    caller owns it."""
    if isinstance(url, str):
        return factory.from_url(url), True
    return url, False


OWN_PENDING_BATCH = 500


def own_pending(client: Any, stream: str, group: str,
                consumer: str) -> list[tuple[Any, Any, int]]:
    """Up to 500 deliveries pending under ``consumer`` (oldest first) as (entry id,
    fields, delivery count): XPENDING for the ids and counts, then XCLAIM to the same
    consumer for the fields (an entry deleted meanwhile leaves the pending list there)."""
    pending = client.xpending_range(stream, group, min="-", max="+",
                                    count=OWN_PENDING_BATCH, consumername=consumer)
    return _with_fields(pending, client.xclaim(stream, group, consumer, 0,
                                               [p["message_id"] for p in pending])
                        if pending else [])


async def own_pending_async(client: Any, stream: str, group: str,
                            consumer: str) -> list[tuple[Any, Any, int]]:
    """:func:`own_pending` on a ``redis.asyncio`` client."""
    pending = await client.xpending_range(stream, group, min="-", max="+",
                                          count=OWN_PENDING_BATCH, consumername=consumer)
    if not pending:
        return []
    return _with_fields(pending, await client.xclaim(
        stream, group, consumer, 0, [p["message_id"] for p in pending]))


def _with_fields(pending: list[dict[str, Any]], claimed: Any) -> list[tuple[Any, Any, int]]:
    counts = {codec.text(p["message_id"]): int(p["times_delivered"]) for p in pending}
    return [(entry_id, fields, counts.get(codec.text(entry_id), 1))
            for entry_id, fields in claimed or () if fields is not None]


class StreamsSettings:
    """The settings and per-group bookkeeping every Redis Streams adapter (sync and
    async) starts with: one place for their meaning and defaults."""

    consumer: str
    visibility_timeout: float
    claim_interval: float
    maxlen: int | None
    dead_letter_maxlen: int | None
    start_id: str
    promote_interval: float
    max_message_bytes: int | None

    def _configure(self, url: Any, factory: Any, options: Mapping[str, Any]) -> None:
        """Apply the constructor's ``url`` (see :func:`client_from`) and options."""
        self.max_message_bytes = check_max_message_bytes(options["max_message_bytes"])
        visibility_timeout = options["visibility_timeout"]
        if visibility_timeout <= 0:
            raise ConfigurationError("visibility_timeout must be positive")
        self._redis, self._owns_client = client_from(url, factory)
        self.consumer = options["consumer"] or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.visibility_timeout = visibility_timeout
        claim_interval = options["claim_interval"]
        self.claim_interval = (claim_interval if claim_interval is not None
                               else min(max(visibility_timeout / 4, 0.05), 30.0))
        self.maxlen = options["maxlen"]
        self.dead_letter_maxlen = options["dead_letter_maxlen"]
        self.start_id = options["start_id"]
        self.promote_interval = options["promote_interval"]
        self._settle_script = self._redis.register_script(SETTLE)
        self._promote_script = self._redis.register_script(PROMOTE)
        self._claim_script = self._redis.register_script(CLAIM)
        self._groups: set[tuple[str, str]] = set()
        #: (stream, group) -> (topic, retry stream?) of every group this broker made sure of.
        self._origins: dict[tuple[str, str], tuple[str, bool]] = {}
        #: (stream, group) -> the highest entry id a read handed to this consumer.
        self._seen: dict[tuple[str, str], str] = {}
        #: (stream, group) -> where to read this consumer's own pending entries again:
        #: a read whose reply was lost left entries pending under this consumer that no
        #: fetch returned (all of them above the highest id seen before that read).
        self._reread: dict[tuple[str, str], str] = {}
        self._claim_at: dict[tuple[str, str], float] = {}
        self._cursors: dict[tuple[str, str], bytes] = {}
        self._promote_at: dict[tuple[str, str], float] = {}
        self._next_due: dict[tuple[str, str], float] = {}
