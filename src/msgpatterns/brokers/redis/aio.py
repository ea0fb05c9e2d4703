"""AsyncRedisStreamsBroker: the :class:`~msgpatterns.aio.base.AsyncBroker` protocol on
Redis Streams consumer groups, with ``redis.asyncio``.

Same keys, same entries, same Lua scripts and the same entry decoding as the sync
:class:`~msgpatterns.brokers.RedisStreamsBroker` (both use the wire core,
:mod:`msgpatterns.brokers.redis._wire`, and copy nothing), so the two read each
other's messages, retries and dead letters, and ``msgpatterns dlq`` (the sync
adapter's admin) manages the dead letters of both:

* ``S`` - the topic stream; ``S:retry:G`` - group ``G``'s redeliveries;
  ``S:delayed:G`` - its delayed retries (sorted by due time, Redis server clock);
  ``S:dlq`` - dead letters with the full record.
* At least once: a delivery stays pending until acked, moved to the retry path or
  dead-lettered; one left pending longer than ``visibility_timeout`` is claimed by
  another consumer (XAUTOCLAIM) with its delivery count, so the attempt is durable.
* Moving a delivery (nack, dead letter) is one Lua script: copy written and original
  acked together or not at all; a settlement from a consumer whose delivery was
  claimed meanwhile does nothing.
* An entry that cannot be decoded is dead-lettered on its own with the reason; the
  rest of the fetch is delivered.
* A lost consumer group (NOGROUP) is re-created at ``0`` and logged as an error.
* Nothing stranded: an ``XREADGROUP`` whose reply is lost with its connection is sent
  again as a read of this consumer's own pending entries above
  the last one it was handed, so what the lost reply held comes back at once, before
  new entries; :meth:`AsyncRedisStreamsBroker.close` hands back every delivery still
  pending under this consumer (see the sync adapter).

Differences from the sync adapter: acks are sent at once (no ack batching: a crash
loses none). As there, a connection failure is retried with backoff (5 attempts), then
raises :class:`~msgpatterns.errors.BrokerUnavailable`. The dead-letter admin is the
sync one (:meth:`AsyncRedisStreamsBroker.dead_letter_admin`), on a sync client to
the same server.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import tenacity

from msgpatterns import _redispy as redispy
from msgpatterns._callables import renamed_arguments
from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import admin_for
from msgpatterns.brokers._aio_adapter import AsyncBrokerAdapter
from msgpatterns.brokers._batch import outgoing
from msgpatterns.brokers._reconnect import reconnect_backoff
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.redis._link import (
    AUTH_ERRORS,
    CONNECTION_ERRORS,
    NoGroup,
    StreamsSettings,
    own_pending_async,
    redis,
    redis_error,
)
from msgpatterns.brokers.redis._wire import (
    EntryDecoder,
    Receipt,
    dead_letter_stream,
    delayed_set,
    entry,
    mark_lost,
    message_id,
    note_seen,
    pack,
    reread_done,
    retry_stream,
    to_bytes,
)
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import BrokerClosed, BrokerError
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES
from msgpatterns.message import Message

aioredis: Any = importlib.import_module("redis.asyncio")

__all__ = ["AsyncRedisStreamsBroker"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a Redis Streams broker"

log = logging.getLogger("msgpatterns.aio.redis")

T = TypeVar("T")

class _Buried(list[tuple[Message, DeadLetter]]):
    """The dead letters of entries a fetch could not decode, sent after it."""

    def bury(self, message: Message, record: DeadLetter) -> None:
        self.append((message, record))


class AsyncRedisStreamsBroker(StreamsSettings, AsyncBrokerAdapter):
    """The async Broker protocol on Redis Streams (see the module docstring).

    Args:
        url: a ``redis://`` URL, or a ``redis.asyncio.Redis`` client (shared; not closed by
            :meth:`close`; it must not decode responses) or a ``redis://`` URL.
        consumer: this consumer's name in its groups (default: host, pid, random).
        visibility_timeout: seconds a delivery may stay unsettled before another
            consumer claims it (keep it above the consumer's ``ack_timeout``).
        claim_interval: how often a fetch looks for stale deliveries (default: a
            quarter of the visibility timeout, at most 30 s).
        maxlen: approximate cap of each topic stream on publish (None: no trimming).
        dead_letter_maxlen: approximate cap of each dead-letter stream (None).
        start_id: where a new group starts: ``"0"`` (default) or ``"$"``.
        promote_interval: how often a fetch moves due delayed retries into the retry
            stream (a retry is at most this late).
        max_message_bytes: the largest entry (body plus other fields) handed to the
            handler; a larger one is dead-lettered with the reason, its raw body kept
            (None: no bound; see :mod:`msgpatterns.limits`).
    """

    @renamed_arguments(client_or_url="url")
    def __init__(
        self,
        url: Any,
        *,
        consumer: str | None = None,
        visibility_timeout: float = 1800.0,
        claim_interval: float | None = None,
        maxlen: int | None = None,
        dead_letter_maxlen: int | None = None,
        start_id: str = "0",
        promote_interval: float = 0.05,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._configure(url, aioredis.Redis, locals())  # the options, by their names
        self._closed = False
        self._fetches = 0
        self._no_fetch = asyncio.Event()
        self._no_fetch.set()

    # -- AsyncBroker protocol ---------------------------------------------------------

    async def _publish(self, topic: str, payload: bytes, key: str | None,
                       headers: Mapping[str, str]) -> str:
        """Add a message to stream ``topic``; its id is ``"<topic>/<entry id>"``."""
        fields = entry(payload, codec.wire_headers(headers, key=key))
        entry_id = await self._do(self._redis.xadd, topic, fields, maxlen=self.maxlen,
                                  approximate=True)
        return message_id(topic, codec.text(entry_id))

    async def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Add ``items`` in one MULTI/EXEC (all or nothing); returns their ids."""
        self._check_open()
        entries = [entry(body_bytes(item.body), codec.wire_headers(item.headers, key=item.key))
                   for item in outgoing(items)]
        if not entries:
            return []

        async def send() -> Any:
            async with self._redis.pipeline(transaction=True) as pipe:
                for fields in entries:
                    pipe.xadd(topic, fields, maxlen=self.maxlen, approximate=True)
                return await pipe.execute()

        return [message_id(topic, codec.text(e)) for e in await self._do(send)]

    async def subscribe(self, topic: str, group: str) -> None:
        """Create ``group`` on ``topic`` now (a fetch does it otherwise)."""
        self._check_open()
        await self._ensure_groups([topic], group)

    async def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                             timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries: stale ones claimed from dead consumers,
        due retries, then new entries (waiting up to ``timeout`` seconds). A fetch that
        returns after :meth:`close` began hands back what it read and raises
        :class:`~msgpatterns.errors.BrokerClosed`."""
        self._check_open()
        self._fetches += 1
        self._no_fetch.clear()
        try:
            out = await self._fetch(list(topics), group, max_messages, timeout)
            if self._closed:
                await self._hand_back(out)
                raise BrokerClosed(f"{self!r} was closed during the fetch")
            return out
        finally:
            self._fetches -= 1
            if not self._fetches:
                self._no_fetch.set()

    async def ack(self, message: Message) -> None:
        """XACK the delivery (and XDEL a retry-stream entry) now."""
        self._check_open()
        await self._ack_receipt(receipt_of(message, Receipt, _OWNER))

    async def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds to this group only, with ``attempt + 1``,
        the original payload and the message's headers as they are now."""
        self._check_open()
        await self._redeliver(message, delay)

    async def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Add the record to ``<topic>:dlq`` and remove the delivery, atomically."""
        self._check_open()
        await self._bury(message, record)

    async def close(self) -> None:
        """No operation starts any more (each raises BrokerClosed); a fetch in progress
        (bounded by its timeout) hands back what it read; then every delivery still
        pending under this consumer is handed back to its group's retry stream (attempt
        unchanged), where any consumer reads it at once: what a consumer fetched and
        did not settle before ``close()`` never waits for ``visibility_timeout``; the
        client is closed if this broker created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._no_fetch.wait()
            await self._hand_back_pending()
        finally:
            if self._owns_client:
                await self._redis.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The sync admin of the ``<topic>:dlq`` streams
        (:class:`~msgpatterns.brokers.redis.admin.RedisStreamsDeadLetters`), on a sync
        client of its own to the same server (closed by the admin's ``close()``)."""
        self._check_open()
        client = redispy.sync_twin(self._redis)
        return admin_for("msgpatterns.brokers.redis.admin:RedisStreamsDeadLetters",
                         client, owned=True, check=self._check_open)

    # -- internals --------------------------------------------------------------------

    async def _do(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """``await fn(*args, **kwargs)``, sent again with backoff if the connection fails
        (5 attempts, as the sync adapter; never once closed, never an auth failure):
        redis-py's own ``Retry`` makes none by default, so one connection the server
        closed while it sat in the pool would otherwise fail a settlement. Every
        command here may run twice (XACK, the settle script's ownership check, a read
        of a lost reply reads own pending entries again; a publish whose reply was lost
        can add its entries twice: at least once). redis-py's exceptions come out as
        the library's own."""
        try:
            try:
                return await fn(*args, **kwargs)
            except CONNECTION_ERRORS as exc:
                if self._closed or isinstance(exc, AUTH_ERRORS):
                    raise
                log.warning("redis call failed; retrying", exc_info=True)
            async for attempt in tenacity.AsyncRetrying(
                    retry=(tenacity.retry_if_exception_type(CONNECTION_ERRORS)
                           & tenacity.retry_if_not_exception_type(AUTH_ERRORS)),
                    wait=reconnect_backoff(2.0), stop=tenacity.stop_after_attempt(4),
                    reraise=True):
                with attempt:
                    self._check_open()  # a closed broker never reconnects
                    return await fn(*args, **kwargs)
            raise AssertionError("unreachable: tenacity re-raises the last error")
        except BrokerError:
            raise
        except redis.RedisError as exc:
            raise redis_error(exc, repr(self), self._closed) from exc

    async def _recovering(self, topics: Sequence[str], group: str,
                          fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)``; if the group is gone (NOGROUP), re-create it, again."""
        try:
            return await fn(*args)
        except NoGroup:
            self._groups -= {g for g in self._groups if g[1] == group}
            await self._ensure_groups(topics, group, lost=True)
            return await fn(*args)

    async def _ensure_groups(self, topics: Sequence[str], group: str,
                             lost: bool = False) -> None:
        for topic in topics:
            for stream in (topic, retry_stream(topic, group)):
                if (stream, group) in self._groups:
                    continue
                try:
                    await self._do(self._redis.xgroup_create, stream, group,
                                   id="0" if lost else self.start_id, mkstream=True)
                    if lost:
                        log.error("%s: consumer group %r of stream %r was lost; re-created "
                                  "it at 0 (its pending deliveries are gone; entries still "
                                  "in the stream are read again)", self.consumer, group,
                                  stream)
                except BrokerError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                self._groups.add((stream, group))
                self._origins[(stream, group)] = (topic, stream != topic)

    async def _fetch(self, topics: list[str], group: str, max_messages: int,
                     timeout: float) -> list[Message]:
        await self._ensure_groups(topics, group)
        buried = _Buried()
        decoder = EntryDecoder(self.consumer, self.max_message_bytes, buried.bury,
                               self.wire_bounds)
        wait = timeout
        now = time.monotonic()
        for topic in topics:
            slot = (topic, group)
            if now >= self._promote_at.get(slot, 0.0):
                await self._recovering(topics, group, self._promote, topic, group,
                                       max(max_messages, 100), now)
            due = self._next_due.get(slot)
            if due is not None:  # block no longer than until a known retry is due
                wait = min(wait, max(0.0, due - now))
        out = await self._recovering(topics, group, self._claim_stale, topics, group,
                                     max_messages, decoder)
        remaining = max_messages - len(out)
        if remaining > 0:
            block = None if out or wait <= 0 else max(1, int(wait * 1000))
            got = await self._recovering(topics, group, self._read, topics, group,
                                         remaining, block, decoder)
            out.extend(got[:remaining])
            await self._hand_back(got[remaining:])  # several streams gave COUNT each
        for message, record in buried:
            await self._bury(message, record)
        return out

    async def _promote(self, topic: str, group: str, limit: int, now: float) -> None:
        moved, until_due = await self._do(
            self._promote_script,
            keys=[delayed_set(topic, group), retry_stream(topic, group)], args=[limit])
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

    async def _claim_stale(self, topics: Sequence[str], group: str, limit: int,
                           decoder: EntryDecoder) -> list[Message]:
        out: list[Message] = []
        now = time.monotonic()
        for topic in topics:
            for stream, retry in ((topic, False), (retry_stream(topic, group), True)):
                slot = (stream, group)
                if now < self._claim_at.get(slot, 0.0) or len(out) >= limit:
                    continue
                cursor, entries, deleted = await self._do(
                    self._claim_script, keys=[stream],
                    args=[group, self.consumer, int(self.visibility_timeout * 1000),
                          self._cursors.get(slot, b"0-0"), limit - len(out)])
                self._cursors[slot] = cursor
                more = codec.text(cursor) != "0-0"
                self._claim_at[slot] = now if more else now + self.claim_interval
                if deleted:
                    log.error("%s: %d pending entries of %s were trimmed before being "
                              "processed: %s", group, len(deleted), stream, deleted[:10])
                for entry_id, fields, deliveries in entries:
                    message = decoder.message(topic, stream, retry, group, entry_id,
                                              fields, int(deliveries))
                    if message is not None:
                        out.append(message)
        return out

    async def _read(self, topics: Sequence[str], group: str, count: int, block: int | None,
                    decoder: EntryDecoder) -> list[Message]:
        streams: dict[str, str] = {}
        origin: dict[str, tuple[str, bool]] = {}
        for topic in topics:
            retry_key = retry_stream(topic, group)
            streams[retry_key] = ">"
            streams[topic] = ">"
            origin[retry_key] = (topic, True)
            origin[topic] = (topic, False)
        reply, ids = await self._do(self._read_own_first, streams, group, count, block)
        deleted = reread_done(reply, self._reread, ids, group)
        if deleted:
            log.error("%s: %d pending entries were trimmed before being processed: %s",
                      group, len(deleted), deleted[:10])
            for stream, entry_id in deleted:
                await self._ack_receipt(Receipt(stream, entry_id, group, *origin[stream]))
        out: list[Message] = []
        pairs = reply.items() if isinstance(reply, dict) else reply or []
        for stream_name, entries in pairs:
            stream = codec.text(stream_name)
            topic, retry = origin[stream]
            if entries:  # the highest id read (a lost reply is read again above it)
                note_seen(self._seen, stream, group, entries[-1][0])
            for entry_id, fields in entries:
                if fields is None:  # trimmed while pending (acked above)
                    continue
                message = decoder.message(topic, stream, retry, group, entry_id, fields, 1)
                if message is not None:
                    out.append(message)
        return out

    async def _read_own_first(self, streams: Mapping[str, str], group: str, count: int,
                              block: int | None) -> tuple[Any, dict[str, str]]:
        """One XREADGROUP on a pool connection, sent again by the connection's
        ``Retry`` when it fails: of this consumer's own pending entries from where a
        lost reply left them (:func:`mark_lost`), for the streams that have some, and
        of new entries for the others (BLOCK only when it reads new entries alone).
        Returns the raw reply and the id each stream was read from."""
        ids: dict[str, str] = {}

        def command() -> list[Any]:
            ids.clear()
            ids.update({stream: self._reread.get((stream, group), ">") for stream in streams})
            again = any(start != ">" for start in ids.values())
            return ["XREADGROUP", "GROUP", group, self.consumer, "COUNT", count,
                    *(("BLOCK", block) if block is not None and not again else ()),
                    "STREAMS", *ids, *ids.values()]

        def lost() -> None:
            mark_lost(self._seen, self._reread, ids, group)  # what it read is pending

        reply = await redispy.read_with_retry(self._redis, command, lost)
        return reply, dict(ids)

    async def _ack_receipt(self, r: Receipt) -> None:
        async def send() -> None:
            if not r.retry:
                await self._redis.xack(r.stream, r.group, r.entry_id)
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xack(r.stream, r.group, r.entry_id)
                pipe.xdel(r.stream, r.entry_id)
                await pipe.execute()

        await self._do(send)

    async def _hand_back_pending(self) -> None:
        """:meth:`close`: hand back every delivery still pending under this consumer in
        the groups it used. Redis unreachable: logged, and those deliveries come back
        after ``visibility_timeout`` (none is lost)."""
        buried = _Buried()
        decoder = EntryDecoder(self.consumer, self.max_message_bytes, buried.bury,
                               self.wire_bounds)
        try:
            for (stream, group), (topic, retry) in sorted(self._origins.items()):
                first = None
                while True:
                    entries = await self._do(own_pending_async, self._redis, stream, group,
                                             self.consumer)
                    if not entries or entries[0][0] == first:  # none, or none could move
                        break
                    first = entries[0][0]
                    for entry_id, fields, deliveries in entries:
                        message = decoder.message(topic, stream, retry, group, entry_id,
                                                  fields, deliveries)
                        if message is not None:
                            await self._redeliver(message, 0.0, attempt=message.attempt)
            for message, record in buried:
                await self._bury(message, record)
        except BrokerError:
            log.warning("%s: could not hand back the deliveries pending under this "
                        "consumer on close(); they come back after visibility_timeout",
                        self.consumer, exc_info=True)

    async def _hand_back(self, messages: Sequence[Message]) -> None:
        """Return deliveries no handler saw, their attempt unchanged."""
        for message in messages:
            await self._redeliver(message, 0.0, attempt=message.attempt)

    async def _redeliver(self, message: Message, delay: float,
                         attempt: int | None = None) -> None:
        r = receipt_of(message, Receipt, _OWNER)
        fields = entry(body_bytes(message.raw_body),
                        codec.redelivery_headers(message, group=r.group, attempt=attempt))
        if delay > 0:
            flat = [to_bytes(x) for pair in fields.items() for x in pair]
            member = pack([f"{r.stream}/{r.entry_id}".encode(), *flat])
            moved = await self._move(r, delayed_set(r.topic, r.group), "zset", [member],
                                     delay_ms=max(1, round(delay * 1000)))
            due = time.monotonic() + delay
            slot = (r.topic, r.group)
            self._next_due[slot] = min(self._next_due.get(slot, due), due)
            self._promote_at[slot] = min(self._promote_at.get(slot, due), due)
        else:
            moved = await self._move(r, retry_stream(r.topic, r.group), "stream", fields)
        if not moved:
            log.debug("nack of %s ignored: claimed by another consumer", message.id)

    async def _bury(self, message: Message, record: DeadLetter) -> None:
        r = receipt_of(message, Receipt, _OWNER)
        fields = entry(codec.dead_letter_body(record), codec.dead_letter_headers(record))
        moved = await self._move(r, dead_letter_stream(r.topic), "stream", fields,
                                 maxlen=self.dead_letter_maxlen)
        if not moved:
            log.debug("dead letter of %s ignored: claimed by another consumer", message.id)

    async def _move(self, r: Receipt, target: str, mode: str,
                    fields: Mapping[str, Any] | list[bytes], *, delay_ms: int = 0,
                    maxlen: int | None = None) -> bool:
        values = fields if isinstance(fields, list) else [
            x for pair in fields.items() for x in pair]
        result = await self._recovering(
            [r.topic], r.group, self._do, self._settle_script, [r.stream, target],
            [r.group, self.consumer, r.entry_id, "1" if r.retry else "0", mode, delay_ms,
             "" if maxlen is None else maxlen, *values])
        return bool(result)

    def __repr__(self) -> str:
        return f"AsyncRedisStreamsBroker(consumer={self.consumer!r})"
