"""Settle deliveries of a redis-py XREADGROUP loop you own, the RedisStreamsBroker way.

Every step goes through the adapter (:class:`~msgpatterns.brokers.RedisStreamsBroker`)
with your client and your consumer name, so the keys, the entry format and the Lua
scripts are the adapter's own: a retry is moved to ``S:delayed:G`` and acked in one
script, due retries reach ``S:retry:G``, dead letters land in ``S:dlq`` with their full
record (``msgpatterns dlq`` lists and replays them), and the attempt count is the
attempt header plus the entry's delivery count.

A loop::

    loop = RedisLoop(client, group="billing", consumer="billing-1")
    loop.subscribe("orders")
    while running:
        for message in loop.recover("orders"):          # own pending list, then stale
            loop.handle(message, charge, policy=policy)   # entries of dead consumers
        wait = loop.promote("orders")                   # due retries -> S:retry:G
        reply = client.xreadgroup("billing", "billing-1", loop.streams("orders"),
                                  count=10, block=loop.block_ms(wait, 1.0))
        for message in loop.messages(reply):
            loop.handle(message, charge, policy=policy)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from msgpatterns.brokers import codec
from msgpatterns.brokers.loop import RawLoop, carry_out
from msgpatterns.brokers.redis.broker import RedisStreamsBroker
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES
from msgpatterns.message import Message
from msgpatterns.settlement import Decision

__all__ = ["RedisLoop"]


class RedisLoop(RawLoop):
    """The settlement side of a redis-py consumer-group loop.

    Guarantees (the adapter's): a retry or dead letter is written and the delivery
    acked atomically, and only while the delivery is still this consumer's; a retry is
    never delivered before its delay (Redis server time) and only to this group;
    ``message.id`` is ``"<stream>/<entry id>"`` and survives retries.

    Args:
        client: a ``redis.Redis`` (not closed by :meth:`close`).
        group: the consumer group, as in your XREADGROUP calls.
        consumer: this consumer's name, as in your XREADGROUP calls.
        visibility_timeout: seconds a delivery may stay unsettled before
            :meth:`recover` claims it from a dead consumer.
        dead_letter_maxlen: approximate cap of ``S:dlq`` (None: no trimming).
        max_message_bytes: as for ``RedisStreamsBroker``: a larger entry is
            dead-lettered with the reason (default 16 MiB, None: no bound).
    """

    def __init__(self, client: Any, *, group: str, consumer: str,
                 visibility_timeout: float = 1800.0,
                 dead_letter_maxlen: int | None = None,
                 max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.group = group
        self.consumer = consumer
        self.broker = RedisStreamsBroker(
            client, consumer=consumer, visibility_timeout=visibility_timeout,
            dead_letter_maxlen=dead_letter_maxlen, ack_flush_interval=0,
            max_message_bytes=max_message_bytes,
        )
        self._own_pending: dict[str, str] = {}  # stream -> last id re-read ("": done)

    # -- reading --------------------------------------------------------------------

    def subscribe(self, *topics: str) -> None:
        """Create the group on each topic and its retry stream (idempotent)."""
        for topic in topics:
            self.broker.subscribe(topic, self.group)

    def streams(self, *topics: str) -> dict[str, str]:
        """The ``streams`` argument of XREADGROUP for new deliveries: each topic and its
        retry stream, at ``>``."""
        out: dict[str, str] = {}
        for topic in topics:
            out[self.broker.retry_stream(topic, self.group)] = ">"
            out[topic] = ">"
        return out

    def promote(self, *topics: str) -> float | None:
        """Move due delayed retries into the retry streams; returns seconds until the
        next delayed retry is due (None: none is waiting), to cap your BLOCK time."""
        dues = [due for topic in topics
                if (due := self.broker.promote_due(topic, self.group, 100)) is not None]
        return max(0.0, min(dues) - time.monotonic()) if dues else None

    @staticmethod
    def block_ms(wait: float | None, at_most: float) -> int:
        """XREADGROUP's BLOCK in milliseconds: ``at_most`` seconds, or less when a
        retry is due sooner (``wait`` from :meth:`promote`); at least 1 ms."""
        seconds = at_most if wait is None else min(wait, at_most)
        return max(1, int(seconds * 1000))

    def messages(self, reply: Any) -> list[Message]:
        """The Messages of an XREADGROUP ``>`` reply (RESP2 list or RESP3 dict).
        Entries that cannot be decoded are dead-lettered with a reason and left out;
        entries trimmed while pending are skipped."""
        rows = reply.items() if isinstance(reply, Mapping) else (reply or [])
        out: list[Message] = []
        for stream, entries in rows:
            if isinstance(reply, Mapping):
                entries = entries[0]
            for entry_id, fields in entries:
                message = self.message(codec.text(stream), entry_id, fields)
                if message is not None:
                    out.append(message)
        return out

    def message(self, stream: str, entry_id: Any, fields: Any,
                deliveries: int = 1) -> Message | None:
        """The Message of one entry of ``stream`` (a topic or its retry stream, as
        :meth:`streams` names them); ``deliveries`` is the entry's delivery count (1
        for a ``>`` read). None when the entry was trimmed or could not be decoded
        (then it is dead-lettered with the reason)."""
        if fields is None:
            return None
        topic, retry = self._topic_of(stream)
        return self.broker.message_of(topic, stream, retry, self.group, entry_id, fields,
                                      deliveries)

    def recover(self, *topics: str, count: int = 100) -> list[Message]:
        """Deliveries to process again, at most ``count``: first this consumer's own
        pending list (what it read before a restart and never settled, re-read once and
        paged, so an entry that keeps failing cannot stall the rest), then entries
        other consumers left unsettled longer than ``visibility_timeout`` (XAUTOCLAIM,
        looked for at most every ``claim_interval``). Attempts include the delivery
        count, so a crash counts as an attempt."""
        self.subscribe(*topics)  # once per stream
        out: list[Message] = []
        for topic in topics:
            for stream in (topic, self.broker.retry_stream(topic, self.group)):
                if len(out) < count:
                    out.extend(self._reread_pending(stream, count - len(out)))
        if len(out) < count:
            out.extend(self.broker.claim_stale(list(topics), self.group, count - len(out)))
        return out

    # -- settling -------------------------------------------------------------------

    def apply(self, message: Message, decision: Decision) -> None:
        """Carry out ``decision``: XACK (and XDEL for a retry-stream entry); the retry
        into ``S:delayed:G`` with its due time, atomically with the ack; or the dead
        letter into ``S:dlq`` with its full record, atomically with the ack."""
        carry_out(self.broker, message, decision)

    def close(self) -> None:
        """Release the adapter (the client stays open); later calls raise
        :class:`~msgpatterns.errors.BrokerClosed`."""
        self.broker.close()

    def __enter__(self) -> RedisLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------

    def _topic_of(self, stream: str) -> tuple[str, bool]:
        suffix = self.broker.retry_stream("", self.group)
        if stream.endswith(suffix) and len(stream) > len(suffix):
            return stream[: -len(suffix)], True
        return stream, False

    def _reread_pending(self, stream: str, count: int) -> list[Message]:
        """The next page of this consumer's own pending entries of ``stream``
        (XREADGROUP from an id, which counts a delivery), with their delivery counts."""
        after = self._own_pending.get(stream, "0")
        if after == "":
            return []
        reply = self.broker.call(self.broker.client.xreadgroup, self.group, self.consumer,
                                 {stream: after}, count=count)
        rows = reply.items() if isinstance(reply, Mapping) else (reply or [])
        entries = [e for _, found in rows
                   for e in (found[0] if isinstance(reply, Mapping) else found)]
        if not entries:
            self._own_pending[stream] = ""
            return []
        first, last = codec.text(entries[0][0]), codec.text(entries[-1][0])
        self._own_pending[stream] = last
        counts = {codec.text(p["message_id"]): int(p["times_delivered"]) for p in
                  self.broker.call(self.broker.client.xpending_range, stream, self.group, first,
                                   last, len(entries), consumername=self.consumer)}
        out: list[Message] = []
        for entry_id, fields in entries:
            eid = codec.text(entry_id)
            message = self.message(stream, eid, fields, counts.get(eid, 1))
            if message is not None:
                out.append(message)
        return out
