"""RedisStreamsBroker: the Broker protocol on Redis Streams consumer groups (redis-py).

Keys, for a stream ``S`` (a topic) and a consumer group ``G``:

* ``S`` - the stream producers add to; every group reads all of it (XREADGROUP).
* ``S:retry:G`` - redeliveries meant for ``G`` only: nacked messages whose delay is
  due, and replays. Its entries are deleted once settled.
* ``S:delayed:G`` - a sorted set of ``G``'s delayed retries, scored by due time.
* ``S:dlq`` - dead letters of every group, each entry carrying the full record.

Guarantees:

* At least once: a delivery stays in the group's pending list until it is acked,
  moved to the retry path, or dead-lettered. A delivery left pending longer than
  ``visibility_timeout`` (its consumer died) is claimed by another consumer with
  XAUTOCLAIM.
* The attempt number is durable: the stream's delivery count for crash redeliveries,
  plus the attempt header written when a nacked message is re-added.
* Moving a message (nack, due retry, dead letter) is one Lua script: the copy is
  written and the original acked together or not at all, so a crash never loses or
  duplicates it. A settlement from a consumer whose delivery was claimed by another
  consumer meanwhile does nothing.
* Retries are never delivered before their delay (Redis server time) and reach only
  the group that nacked them.
* Acks are batched: :meth:`RedisStreamsBroker.ack` queues the ack, and queued acks go
  to Redis in one round trip at the next fetch, when ``ack_batch`` are queued, or
  ``ack_flush_interval`` seconds later (and on :meth:`RedisStreamsBroker.close`). A
  crash loses at most that window of acks: those messages are redelivered (at least
  once), never lost. ``ack_flush_interval=0`` sends each ack at once.

Trimming: ``maxlen`` caps ``S`` on publish (approximate ``MAXLEN ~``). Redis trims
regardless of consumer groups, so a cap below the backlog drops unread or pending
entries (logged when XAUTOCLAIM reports them); leave it None (the default) or size it
well above the longest backlog. Retry streams hold only unsettled entries; the
dead-letter stream is trimmed only if ``dead_letter_maxlen`` is set.

With Redis Cluster, put the topic in a hash tag (``{orders}``) so that a stream and its
retry, delayed and dead-letter keys share a slot (the scripts touch several of them).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msgpatterns._extras import require
from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers._dlq import selected
from msgpatterns.brokers._reconnect import reconnecting
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.message import Message

redis = require("redis", "redis")

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)

__all__ = ["RedisStreamsBroker"]

log = logging.getLogger("msgpatterns.brokers.redis")

# Move one delivery of this consumer to a target (a stream, or the delayed set) and ack
# it, atomically. Does nothing when the delivery is no longer this consumer's.
# KEYS: source stream, target. ARGV: group, consumer, entry id, delete source ('1'/'0'),
# 'zset' | 'stream', delay ms, maxlen ('' for none), then the fields (zset: one member).
_SETTLE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
if ARGV[5] == 'zset' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[8])
elseif ARGV[7] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', unpack(ARGV, 8))
else
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 8))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
if ARGV[4] == '1' then redis.call('XDEL', KEYS[1], ARGV[3]) end
return 1
"""

# Move due delayed retries into the group's retry stream, atomically per entry. A
# member is a list of netstrings ("len:bytes"): a unique tag, then field, value, ...
# KEYS: delayed set, retry stream. ARGV: most entries to move.
# Returns {moved, ms until the next delayed retry is due or -1}.
_PROMOTE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[1])
for _, member in ipairs(due) do
  local fields = {}
  local i, n = 1, 0
  while i <= #member do
    local colon = string.find(member, ':', i, true)
    local len = tonumber(string.sub(member, i, colon - 1))
    n = n + 1
    if n > 1 then fields[#fields + 1] = string.sub(member, colon + 1, colon + len) end
    i = colon + len + 1
  end
  redis.call('XADD', KEYS[2], '*', unpack(fields))
  redis.call('ZREM', KEYS[1], member)
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #head == 0 then return {#due, -1} end
return {#due, math.max(0, tonumber(head[2]) - now)}
"""

# Claim deliveries idle longer than the visibility timeout, with their delivery counts.
# KEYS: stream. ARGV: group, consumer, min idle ms, cursor, count.
# Returns {next cursor, {{id, fields, deliveries}...}, {deleted ids}}.
_CLAIM = """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4],
                     'COUNT', ARGV[5])
local entries = {}
for _, e in ipairs(r[2]) do
  if type(e) == 'table' and type(e[2]) == 'table' then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
    entries[#entries + 1] = {e[1], e[2], p[1][4]}
  end
end
return {r[1], entries, r[3] or {}}
"""


@dataclass(slots=True)
class _Receipt:
    stream: str
    entry_id: str
    group: str
    topic: str
    retry: bool


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _pack(parts: Sequence[bytes]) -> bytes:
    """Netstrings the _PROMOTE script unpacks."""
    return b"".join(b"%d:%s" % (len(p), p) for p in parts)


def _fields(raw: Any) -> dict[str, Any]:
    """An entry's fields (a dict from XREADGROUP, a flat list from a script)."""
    if isinstance(raw, dict):
        return {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}
    return {codec.text(raw[i]): raw[i + 1] for i in range(0, len(raw) - 1, 2)}


class RedisStreamsBroker:
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on Redis Streams.

    Args:
        client_or_url: a ``redis.Redis`` client (shared; not closed by :meth:`close`)
            or a ``redis://`` URL.
        consumer: this consumer's name in its groups (default: host, pid and a random
            suffix, so a restarted process is a new consumer).
        visibility_timeout: seconds a delivery may stay unsettled before another
            consumer claims it. Keep it above the Consumer's ``ack_timeout``.
        claim_interval: how often (seconds) a fetch looks for stale deliveries
            (default: a quarter of the visibility timeout, at most 30 s).
        maxlen: approximate cap of each topic stream on publish (None: no trimming).
        dead_letter_maxlen: approximate cap of each dead-letter stream (None).
        start_id: where a new group starts reading: ``"0"`` (the whole stream, the
            default) or ``"$"`` (only messages added from now on).
        ack_flush_interval: longest an ack waits in the batch (seconds; 0: no batch).
        ack_batch: queued acks that trigger a flush.
        promote_interval: how often a fetch moves due delayed retries into the retry
            stream (seconds; a retry is at most this late).
    """

    def __init__(
        self,
        client_or_url: Any,
        *,
        consumer: str | None = None,
        visibility_timeout: float = 1800.0,
        claim_interval: float | None = None,
        maxlen: int | None = None,
        dead_letter_maxlen: int | None = None,
        start_id: str = "0",
        ack_flush_interval: float = 0.05,
        ack_batch: int = 256,
        promote_interval: float = 0.05,
    ) -> None:
        if visibility_timeout <= 0:
            raise ValueError("visibility_timeout must be positive")
        if isinstance(client_or_url, str):
            self._redis = redis.Redis.from_url(client_or_url)
            self._owns_client = True
        else:
            self._redis = client_or_url
            self._owns_client = False
        self.consumer = consumer or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.visibility_timeout = visibility_timeout
        self.claim_interval = (
            claim_interval if claim_interval is not None
            else min(max(visibility_timeout / 4, 0.05), 30.0)
        )
        self.maxlen = maxlen
        self.dead_letter_maxlen = dead_letter_maxlen
        self.start_id = start_id
        self._settle_script = self._redis.register_script(_SETTLE)
        self._promote_script = self._redis.register_script(_PROMOTE)
        self._claim_script = self._redis.register_script(_CLAIM)
        self._lock = threading.Lock()
        self._groups: set[tuple[str, str]] = set()
        self._claim_at: dict[tuple[str, str], float] = {}
        self._cursors: dict[tuple[str, str], bytes] = {}
        self._overflow: list[Message] = []
        self._retrying = reconnecting(
            _CONNECTION_ERRORS, logger=log, what="redis call", attempts=5, max_wait=2.0,
        )
        self.promote_interval = promote_interval
        self._promote_at: dict[tuple[str, str], float] = {}
        self._next_due: dict[tuple[str, str], float] = {}
        self.ack_flush_interval = ack_flush_interval
        self.ack_batch = max(1, ack_batch)
        self._acks: list[_Receipt] = []
        self._ack_lock = threading.Lock()
        self._ack_wake = threading.Event()
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None

    # -- key names ------------------------------------------------------------------

    @staticmethod
    def retry_stream(topic: str, group: str) -> str:
        """The stream of ``group``'s redeliveries of ``topic``."""
        return f"{topic}:retry:{group}"

    @staticmethod
    def delayed_set(topic: str, group: str) -> str:
        """The sorted set of ``group``'s delayed retries of ``topic``."""
        return f"{topic}:delayed:{group}"

    @staticmethod
    def dead_letter_stream(topic: str) -> str:
        """The dead-letter stream of ``topic``."""
        return f"{topic}:dlq"

    # -- Broker protocol ------------------------------------------------------------

    def now(self) -> float:
        return time.time()

    def publish(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Add a message to stream ``topic``; returns its entry id."""
        fields = self._entry(body_bytes(body), codec.wire_headers(headers, key=key))
        entry_id = self._call(
            self._redis.xadd, topic, fields, maxlen=self.maxlen, approximate=True
        )
        return codec.text(entry_id)

    def subscribe(self, topic: str, group: str) -> None:
        """Create ``group`` on ``topic`` now (a fetch does it otherwise)."""
        self._ensure_groups([topic], group)

    def fetch(
        self,
        topics: Sequence[str],
        group: str,
        max_messages: int = 1,
        timeout: float = 0.0,
    ) -> list[Message]:
        """Up to ``max_messages`` deliveries: stale ones claimed from dead consumers,
        due retries, then new entries (waiting up to ``timeout`` seconds)."""
        if isinstance(topics, str):
            topics = [topics]
        self._ensure_groups(topics, group)
        self.flush()
        out = self._take_overflow(topics, group, max_messages)
        wait = timeout
        now = time.monotonic()
        for topic in topics:
            slot = (topic, group)
            if now >= self._promote_at.get(slot, 0.0):
                self._promote(topic, group, max(max_messages, 100), now)
            due = self._next_due.get(slot)
            if due is not None:  # block no longer than until a known retry is due
                wait = min(wait, max(0.0, due - now))
        if len(out) < max_messages:
            out.extend(self._claim_stale(topics, group, max_messages - len(out)))
        remaining = max_messages - len(out)
        if remaining > 0:
            block = None if out or wait <= 0 else max(1, int(wait * 1000))
            read = self._read(topics, group, remaining, block)
            out.extend(read[:remaining])
            if len(read) > remaining:
                with self._lock:
                    self._overflow.extend(read[remaining:])
        return out

    def ack(self, message: Message) -> None:
        """Queue the ack (see the batching note above); :meth:`flush` sends it now."""
        r = self._receipt(message)
        if self.ack_flush_interval <= 0:
            self._send_acks([r])
            return
        with self._ack_lock:
            self._acks.append(r)
            full = len(self._acks) >= self.ack_batch
            if self._flusher is None and not self._closed.is_set():
                self._flusher = threading.Thread(target=self._flush_periodically,
                                                 name=f"{self.consumer}-acks", daemon=True)
                self._flusher.start()
        if full:
            self.flush()

    def flush(self) -> None:
        """Send every queued ack to Redis now."""
        with self._ack_lock:
            batch, self._acks = self._acks, []
        if batch:
            self._send_acks(batch)

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds, to this group only, with ``attempt + 1``,
        the original payload and the message's headers as they are now."""
        self._redeliver(message, delay)

    def _redeliver(self, message: Message, delay: float, attempt: int | None = None) -> None:
        """Move the delivery to the retry path (the delayed set when ``delay`` > 0)."""
        r = self._receipt(message)
        fields = self._entry(
            body_bytes(message.raw_body),
            codec.redelivery_headers(message, group=r.group, attempt=attempt),
        )
        retry = self.retry_stream(r.topic, r.group)
        if delay > 0:
            flat = [_b(x) for pair in fields.items() for x in pair]
            member = _pack([f"{r.stream}/{r.entry_id}".encode(), *flat])
            moved = self._move(r, self.delayed_set(r.topic, r.group), "zset",
                               [member], delay_ms=max(1, round(delay * 1000)))
            due = time.monotonic() + delay
            slot = (r.topic, r.group)
            self._next_due[slot] = min(self._next_due.get(slot, due), due)
            self._promote_at[slot] = min(self._promote_at.get(slot, due), due)
        else:
            moved = self._move(r, retry, "stream", fields)
        if not moved:
            log.debug("nack of %s ignored: claimed by another consumer", message.id)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Add the record to ``<topic>:dlq`` and remove the delivery, atomically."""
        r = self._receipt(message)
        fields = self._entry(codec.dead_letter_body(record), codec.dead_letter_headers(record))
        moved = self._move(r, self.dead_letter_stream(r.topic), "stream", fields,
                           maxlen=self.dead_letter_maxlen)
        if not moved:
            log.debug("dead letter of %s ignored: claimed by another consumer", message.id)

    def close(self) -> None:
        """Hand back deliveries read but never returned by :meth:`fetch` (their attempt
        unchanged) and release the connection pool if this broker created it."""
        with self._lock:
            unused, self._overflow = self._overflow, []
        for message in unused:
            self._redeliver(message, 0.0, attempt=message.attempt)
        self._closed.set()
        self._ack_wake.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        self.flush()
        if self._owns_client:
            self._redis.close()

    # -- dead-letter admin ----------------------------------------------------------

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        """Dead letters of ``topic`` (of ``group``, or all groups), oldest first."""
        out: list[DeadLetter] = []
        for record in self._scan_dead_letters(topic):
            if selected(record, group, None):
                out.append(record)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        """Send dead letters back with attempts reset; each is removed from the
        dead-letter stream in the same transaction that re-adds it."""
        count = 0
        dlq = self.dead_letter_stream(topic)
        for record in self._scan_dead_letters(topic):
            if not selected(record, group, ids):
                continue
            owner = record.group or group
            if not to_topic and not owner:
                raise ValueError(f"dead letter {record.id} has no group; pass group=")
            target = topic if to_topic else self.retry_stream(topic, owner or "")
            fields = self._entry(
                body_bytes(record.message.raw_body),
                codec.replay_headers(record, group=None if to_topic else owner),
            )
            pipe = self._redis.pipeline(transaction=True)
            pipe.xadd(target, fields)
            pipe.xdel(dlq, record.extra["dlq_entry"])
            pipe.execute()
            count += 1
        return count

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        """Delete dead letters; returns how many."""
        doomed = [r.extra["dlq_entry"] for r in self._scan_dead_letters(topic)
                  if selected(r, group, ids)]
        for start in range(0, len(doomed), 500):
            self._redis.xdel(self.dead_letter_stream(topic), *doomed[start:start + 500])
        return len(doomed)

    # -- internals --------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried with backoff if the connection fails."""
        try:
            return fn(*args, **kwargs)
        except _CONNECTION_ERRORS:
            log.warning("redis call failed; retrying", exc_info=True)
            return self._retrying(fn, *args, **kwargs)

    def _flush_periodically(self) -> None:
        while not self._closed.is_set():
            self._ack_wake.wait(self.ack_flush_interval)
            try:
                self.flush()
            except Exception:
                log.exception("%s: sending acks failed; those messages will be "
                              "redelivered", self.consumer)

    def _send_acks(self, batch: Sequence[_Receipt]) -> None:
        """One round trip: XACK per stream (and XDEL for retry-stream entries)."""
        by_stream: dict[tuple[str, str, bool], list[str]] = {}
        for r in batch:
            by_stream.setdefault((r.stream, r.group, r.retry), []).append(r.entry_id)

        def send() -> None:
            if len(by_stream) == 1 and not next(iter(by_stream))[2]:
                (stream, group, _), ids = next(iter(by_stream.items()))
                self._redis.xack(stream, group, *ids)  # the common case: one command
                return
            # XACK is idempotent and an acked retry entry is never read again (reads
            # take new entries only), so these need no MULTI/EXEC around them.
            pipe = self._redis.pipeline(transaction=False)
            for (stream, group, retry), ids in by_stream.items():
                pipe.xack(stream, group, *ids)
                if retry:
                    pipe.xdel(stream, *ids)
            pipe.execute()

        self._call(send)

    @staticmethod
    def _entry(body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        fields: dict[str, Any] = {"body": body}
        if headers:
            fields["headers"] = codec.dumps_headers(headers)
        return fields

    def _ensure_groups(self, topics: Sequence[str], group: str) -> None:
        for topic in topics:
            for stream in (topic, self.retry_stream(topic, group)):
                if (stream, group) in self._groups:
                    continue
                try:
                    self._call(self._redis.xgroup_create, stream, group,
                               id=self.start_id, mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                self._groups.add((stream, group))

    def _promote(self, topic: str, group: str, limit: int, now: float) -> None:
        """Move due retries into the retry stream; note when (monotonic) to look again
        (after ``promote_interval``, or when the next delayed retry is due)."""
        moved, until_due = self._call(
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
        out: list[Message] = []
        now = time.monotonic()
        for topic in topics:
            for stream, retry in ((topic, False), (self.retry_stream(topic, group), True)):
                slot = (stream, group)
                if now < self._claim_at.get(slot, 0.0) or len(out) >= limit:
                    continue
                self._claim_at[slot] = now + self.claim_interval
                cursor, entries, deleted = self._call(
                    self._claim_script,
                    keys=[stream],
                    args=[group, self.consumer, int(self.visibility_timeout * 1000),
                          self._cursors.get(slot, b"0-0"), limit - len(out)],
                )
                self._cursors[slot] = cursor
                if deleted:
                    log.error("%s: %d pending entries of %s were trimmed before being "
                              "processed: %s", group, len(deleted), stream, deleted[:10])
                for entry_id, fields, deliveries in entries:
                    out.append(self._message(topic, stream, retry, group, entry_id,
                                             _fields(fields), int(deliveries)))
        if out:
            log.info("%s: claimed %d stale deliveries", group, len(out))
        return out

    def _read(self, topics: Sequence[str], group: str, count: int,
              block: int | None) -> list[Message]:
        streams: dict[str, str] = {}
        origin: dict[str, tuple[str, bool]] = {}
        for topic in topics:
            retry_key = self.retry_stream(topic, group)
            streams[retry_key] = ">"
            streams[topic] = ">"
            origin[retry_key] = (topic, True)
            origin[topic] = (topic, False)
        reply = self._call(self._redis.xreadgroup, group, self.consumer, streams,
                           count=count, block=block)
        out: list[Message] = []
        for stream_name, entries in reply or []:
            stream = codec.text(stream_name)
            topic, retry = origin[stream]
            for entry_id, fields in entries:
                if fields is None:  # trimmed while pending
                    continue
                out.append(self._message(topic, stream, retry, group, entry_id,
                                         _fields(fields), 1))
        return out

    def _message(self, topic: str, stream: str, retry: bool, group: str, entry_id: Any,
                 fields: dict[str, Any], deliveries: int) -> Message:
        eid = codec.text(entry_id)
        body = fields.get("body")
        if body is None:  # an entry from a producer that does not use msgpatterns
            body = json.dumps({k: codec.text(v) for k, v in fields.items()}).encode()
        raw_headers = fields.get("headers")
        if raw_headers is None:  # the common case, kept cheap
            message = Message(_b(body), id=eid, topic=topic,
                              timestamp=int(eid.split("-", 1)[0]) / 1000, attempt=deliveries)
        else:
            t = codec.split_transport(codec.loads_headers(raw_headers))
            message = Message(
                _b(body),
                id=t.id or eid,
                key=t.key,
                topic=topic,
                headers=t.headers,
                timestamp=t.timestamp or int(eid.split("-", 1)[0]) / 1000,
                attempt=codec.attempt_of(t.headers, deliveries - 1),
            )
        message.receipt = _Receipt(stream, eid, group, topic, retry)
        return message

    def _take_overflow(self, topics: Sequence[str], group: str, limit: int) -> list[Message]:
        with self._lock:
            if not self._overflow:
                return []
            taken: list[Message] = []
            kept: list[Message] = []
            for m in self._overflow:
                r = m.receipt
                if len(taken) < limit and r.group == group and r.topic in topics:
                    taken.append(m)
                else:
                    kept.append(m)
            self._overflow = kept
            return taken

    def _move(self, r: _Receipt, target: str, mode: str, fields: Mapping[str, Any] | list[bytes],
              *, delay_ms: int = 0, maxlen: int | None = None) -> bool:
        values = fields if isinstance(fields, list) else [
            x for pair in fields.items() for x in pair
        ]
        result = self._call(
            self._settle_script,
            keys=[r.stream, target],
            args=[r.group, self.consumer, r.entry_id, "1" if r.retry else "0", mode,
                  delay_ms, "" if maxlen is None else maxlen, *values],
        )
        return bool(result)

    def _scan_dead_letters(self, topic: str) -> list[DeadLetter]:
        out: list[DeadLetter] = []
        for entry_id, raw in self._redis.xrange(self.dead_letter_stream(topic)):
            fields = _fields(raw)
            eid = codec.text(entry_id)
            out.append(codec.read_dead_letter(
                _b(fields.get("body", b"")), codec.loads_headers(fields.get("headers")),
                fallback_id=eid, fallback_topic=topic, location={"dlq_entry": eid},
            ))
        return out

    @staticmethod
    def _receipt(message: Message) -> _Receipt:
        receipt = message.receipt
        if not isinstance(receipt, _Receipt):
            raise ValueError(f"{message!r} was not delivered by a RedisStreamsBroker")
        return receipt

    def __repr__(self) -> str:
        return f"RedisStreamsBroker(consumer={self.consumer!r})"
