"""Dead letters of framework tasks (Celery, Dramatiq) where ``msgpatterns dlq`` sees them.

:class:`RedisDeadLetterStore` is a :class:`~msgpatterns.deadletter.DeadLetterStore`
that keeps each record in the Redis stream ``<topic>:dlq`` in the Redis Streams
adapter's own wire format, so ``msgpatterns dlq list|show|replay|purge --topic <topic>
redis://...`` reads it like a dead letter of a Redis Streams consumer (the topic is the
record's ``message.topic``: the Celery task name, the Dramatiq queue name).

``msgpatterns dlq replay`` puts a replayed message on ``<topic>:retry:<group>`` (the
group that dead-lettered it) or, with ``--to-topic``, on ``<topic>``. A framework does
not read those streams; :meth:`RedisDeadLetterStore.take_replays` hands each replayed
message to a function that sends it back through the framework (the integrations'
``resend_replayed``), then deletes it.

Guarantees:

* ``put`` returns only after Redis stored the record (``XADD``); it raises
  :class:`~msgpatterns.errors.BrokerUnavailable` when Redis is unreachable, never
  silently drops a record.
* ``take_replays`` deletes an entry only after ``send`` returned: a crash in between
  sends it again (at least once; ``@idempotent`` absorbs the duplicate), never loses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from msgpatterns._extras import require
from msgpatterns.brokers import codec
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import BrokerUnavailable, ConfigurationError
from msgpatterns.message import Message

require("redis", "redis")

import redis  # noqa: E402

__all__ = ["RedisDeadLetterStore"]


def _stream(topic: str, suffix: str) -> str:
    return f"{topic}:{suffix}"


class RedisDeadLetterStore:
    """Dead letters in ``<topic>:dlq`` Redis streams, readable by ``msgpatterns dlq``.

    Args:
        url: a ``redis://`` URL (the store opens and closes its own client) or a
            ``redis.Redis`` client (shared: :meth:`close` leaves it open).
        maxlen: keep about this many records per stream (``XADD MAXLEN ~``); None:
            all of them.
    """

    def __init__(self, url: str | redis.Redis, *, maxlen: int | None = None) -> None:
        if isinstance(url, str):
            self._redis: redis.Redis = redis.Redis.from_url(url)
            self._owned = True
        elif isinstance(url, redis.Redis):
            self._redis, self._owned = url, False
        else:
            raise ConfigurationError(
                f"RedisDeadLetterStore needs a redis:// URL or a redis.Redis client, "
                f"got {type(url).__name__}")
        if maxlen is not None and maxlen <= 0:
            raise ConfigurationError(f"maxlen must be positive or None, got {maxlen!r}")
        self.maxlen = maxlen

    def _do(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            raise BrokerUnavailable(f"{self!r}: {type(exc).__name__}") from exc

    def put(self, record: DeadLetter) -> None:
        """Add ``record`` to ``<message.topic>:dlq``."""
        fields = {"body": codec.dead_letter_body(record),
                  "headers": codec.dumps_headers(codec.dead_letter_headers(record))}
        self._do(self._redis.xadd, _stream(record.message.topic, "dlq"), fields,
                 maxlen=self.maxlen, approximate=True)

    def take_replays(self, topic: str, group: str, send: Callable[[Message], None]) -> int:
        """Hand every message ``msgpatterns dlq replay`` put back for ``topic`` (to
        ``group``'s retry stream or to the topic) to ``send``, oldest first, deleting
        each once ``send`` returned; how many. The messages keep their id, key and
        headers, with the attempt count reset. An error from ``send`` stops the call
        and leaves that message and the rest in place."""
        count = 0
        for stream in (_stream(topic, f"retry:{group}"), topic):
            for entry_id, raw in self._do(self._redis.xrange, stream):
                fields = {codec.text(k): v for k, v in raw.items()}
                t = codec.split_transport(codec.loads_headers(fields.get("headers")))
                body = fields.get("body", b"")
                send(Message(bytes(body) if isinstance(body, bytes) else str(body).encode(),
                             id=t.id, key=t.key, topic=topic, headers=t.headers,
                             timestamp=t.timestamp))
                self._do(self._redis.xdel, stream, entry_id)
                count += 1
        return count

    def close(self) -> None:
        """Close the client the store opened itself; idempotent."""
        if self._owned:
            self._redis.close()

    def __enter__(self) -> RedisDeadLetterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kwargs = self._redis.connection_pool.connection_kwargs
        return (f"RedisDeadLetterStore(host={kwargs.get('host')!r}, "
                f"port={kwargs.get('port')!r}, db={kwargs.get('db')!r})")
