"""RedisStreamsDeadLetters: the dead-letter admin of Redis Streams.

Dead letters of every group sit in the stream ``<topic>:dlq``, each entry carrying the
full record. A replay adds the message to ``<topic>:retry:<group>`` (the group that
dead-lettered it) or ``<topic>`` (every group) and deletes the dead-letter entry in
the same MULTI/EXEC, so a crash never loses or duplicates it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.brokers import codec
from msgpatterns.brokers.admin.base import ScannedDeadLetters
from msgpatterns.brokers.redis._link import client_from, redis, redis_error
from msgpatterns.brokers.redis._wire import (
    Malformed,
    dead_letter_stream,
    entry,
    entry_fields,
    retry_stream,
    to_bytes,
)
from msgpatterns.deadletter import DeadLetter, body_bytes

__all__ = ["RedisStreamsDeadLetters"]

log = logging.getLogger("msgpatterns.brokers.redis")


class RedisStreamsDeadLetters(ScannedDeadLetters):
    """List, replay and purge the dead letters of Redis Streams topics.

    Args:
        url: a ``redis://`` URL (the admin opens and closes its own client) or a
            ``redis.Redis`` client (shared; not closed by :meth:`close`).
        call: runs each Redis call (``call(fn, *args)``); the adapter passes its own,
            which retries a lost connection and refuses calls once it is closed.
            Default: one attempt, redis-py's exceptions turned into the library's.
        owned: close the given client in :meth:`close` (a URL's client always is).
        check: called before each default call (an async adapter passes its
            closed-state check, so the admin of a closed adapter refuses at once).
    """

    def __init__(self, url: Any, *, call: Callable[..., Any] | None = None,
                 owned: bool = False, check: Callable[[], None] | None = None) -> None:
        self._redis, owns = client_from(url, redis.Redis)
        self._owns_client = owns or owned
        self._call = call or self._once
        self._check = check

    def _once(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._check is not None:
            self._check()
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            raise redis_error(exc, repr(self)) from exc

    def knows(self, topic: str, group: str | None = None) -> bool:
        return bool(self._call(self._redis.exists, topic, dead_letter_stream(topic)))

    def close(self) -> None:
        if self._owns_client:
            self._redis.close()

    def _scan(self, topic: str) -> list[DeadLetter]:
        out: list[DeadLetter] = []
        for entry_id, raw in self._call(self._redis.xrange, dead_letter_stream(topic)):
            eid = codec.text(entry_id)
            try:
                fields = entry_fields(raw)
            except Malformed as exc:
                log.warning("dead-letter entry %s of %s skipped: %s", eid, topic,
                            escape_control(exc))
                continue
            out.append(codec.read_dead_letter(
                to_bytes(fields.get("body", b"")), codec.loads_headers(fields.get("headers")),
                fallback_id=eid, fallback_topic=topic, location={"dlq_entry": eid},
            ))
        return out

    def _replay(self, topic: str, record: DeadLetter, owner: str | None) -> None:
        target = topic if owner is None else retry_stream(topic, owner)
        fields = entry(body_bytes(record.message.raw_body),
                       codec.replay_headers(record, group=owner))
        pipe = self._redis.pipeline(transaction=True)
        pipe.xadd(target, fields)
        pipe.xdel(dead_letter_stream(topic), record.extra["dlq_entry"])
        self._call(pipe.execute)

    def _remove(self, topic: str, records: Sequence[DeadLetter]) -> None:
        doomed = [r.extra["dlq_entry"] for r in records]
        for start in range(0, len(doomed), 500):
            self._call(self._redis.xdel, dead_letter_stream(topic), *doomed[start:start + 500])

    def __repr__(self) -> str:
        return f"RedisStreamsDeadLetters({self._redis!r})"
