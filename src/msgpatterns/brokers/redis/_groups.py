"""Where a Redis Streams consumer's deliveries come from besides new entries: its
groups (made sure of once, re-created when Redis lost them), the delayed retries that
are due (moved into the group's retry stream) and the deliveries other consumers left
unsettled past ``visibility_timeout`` (claimed). A part of
:class:`~msgpatterns.brokers.redis.broker.RedisStreamsBroker`: its state is the
adapter's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns.brokers import codec
from msgpatterns.errors import BrokerError
from msgpatterns.message import Message

__all__ = ["GroupUpkeep"]

log = logging.getLogger("msgpatterns.brokers.redis")


class GroupUpkeep:
    """Groups, due retries and stale claims (see the module docstring)."""

    consumer: str
    start_id: str
    visibility_timeout: float
    claim_interval: float
    promote_interval: float
    _redis: Any
    _lock: threading.Lock
    _groups: set[tuple[str, str]]
    _origins: dict[tuple[str, str], tuple[str, bool]]
    _claim_at: dict[tuple[str, str], float]
    _cursors: dict[tuple[str, str], bytes]
    _promote_at: dict[tuple[str, str], float]
    _next_due: dict[tuple[str, str], float]
    _promote_script: Any
    _claim_script: Any

    if TYPE_CHECKING:  # the adapter's own, elsewhere
        def retry_stream(self, topic: str, group: str) -> str: ...
        def delayed_set(self, topic: str, group: str) -> str: ...
        def _do(self, fn: Any, *args: Any, **kwargs: Any) -> Any: ...
        def _message(self, topic: str, stream: str, retry: bool, group: str,
                     entry_id: Any, raw: Any, deliveries: int) -> Message | None: ...

    def _ensure_groups(self, topics: Sequence[str], group: str, lost: bool = False) -> None:
        """Create ``group`` on each topic and its retry stream (MKSTREAM) once. With
        ``lost`` (Redis answered NOGROUP), every group re-created is logged as a loss
        and starts at ``0``: entries still in the stream are read again, none is
        skipped."""
        for topic in topics:
            for stream in (topic, self.retry_stream(topic, group)):
                if (stream, group) in self._groups:
                    continue
                try:
                    self._do(self._redis.xgroup_create, stream, group,
                             id="0" if lost else self.start_id, mkstream=True)
                    if lost:
                        log.error(
                            "%s: consumer group %r of stream %r was lost (Redis restarted "
                            "without persistence, or the group was deleted); re-created "
                            "it at 0. Deliveries pending in the lost group are gone; "
                            "entries still in the stream are read again.",
                            self.consumer, group, stream)
                except BrokerError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                with self._lock:
                    self._groups.add((stream, group))
                    self._origins[(stream, group)] = (topic, stream != topic)


    def _promote(self, topic: str, group: str, limit: int, now: float) -> None:
        """Move due retries into the retry stream; note when (monotonic) to look again
        (after ``promote_interval``, or when the next delayed retry is due)."""
        moved, until_due = self._do(
            self._promote_script,
            keys=[self.delayed_set(topic, group), self.retry_stream(topic, group)],
            args=[limit],
        )
        if int(moved):
            log.debug("%s: %d delayed retries of %s due", group, int(moved), topic)
        again = now + self.promote_interval
        if int(until_due) >= 0:
            due = now + int(until_due) / 1000
            self._next_due[(topic, group)] = due
            again = min(again, due)
        else:
            self._next_due.pop((topic, group), None)
        self._promote_at[(topic, group)] = again


    def _claim_stale(self, topics: Sequence[str], group: str, limit: int) -> list[Message]:
        """Claim up to ``limit`` stale deliveries. A slot whose scan has not wrapped
        (XAUTOCLAIM's cursor is not back at 0-0) is claimed again at the next fetch, so
        a dead consumer's backlog comes back at the rate the consumer fetches; only a
        completed scan waits ``claim_interval``."""
        out: list[Message] = []
        now = time.monotonic()
        for topic in topics:
            for stream, retry in ((topic, False), (self.retry_stream(topic, group), True)):
                slot = (stream, group)
                if now < self._claim_at.get(slot, 0.0) or len(out) >= limit:
                    continue
                cursor, entries, deleted = self._do(
                    self._claim_script,
                    keys=[stream],
                    args=[group, self.consumer, int(self.visibility_timeout * 1000),
                          self._cursors.get(slot, b"0-0"), limit - len(out)],
                )
                self._cursors[slot] = cursor
                more = codec.text(cursor) != "0-0"
                self._claim_at[slot] = now if more else now + self.claim_interval
                if deleted:
                    log.error("%s: %d pending entries of %s were trimmed before being "
                              "processed: %s", group, len(deleted), stream, deleted[:10])
                for entry_id, fields, deliveries in entries:
                    message = self._message(topic, stream, retry, group, entry_id,
                                            fields, int(deliveries))
                    if message is not None:
                        out.append(message)
        if out:
            log.info("%s: claimed %d stale deliveries", group, len(out))
        return out

