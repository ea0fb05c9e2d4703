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
* Acks are batched: :meth:`RedisStreamsBroker.ack` queues the ack of a settled
  delivery (nothing else is ever acked), and queued acks go to Redis in the same write
  as the next fetch's XREADGROUP (no round trip of their own), from the flusher thread
  ``ack_flush_interval`` seconds later or as soon as ``ack_batch`` are queued, and on
  :meth:`RedisStreamsBroker.close`. A crash loses at most that window of acks: those
  messages are redelivered (at least once), never lost. ``ack_flush_interval=0`` sends
  each ack at once.
* Read-ahead: under a backlog (a read filled its count, soon after the previous one)
  the next XREADGROUP is written right away, without BLOCK and with the queued acks,
  and the next fetch takes its reply: Redis prepares the next batch while the handlers
  run. Those entries are pending deliveries of this consumer like the fetched ones;
  :meth:`RedisStreamsBroker.close` hands back any that no fetch took, and so does the
  flusher thread after ``read_ahead_hold`` seconds (a consumer stopped without closing
  its broker). ``read_ahead=False`` turns it off (it is off with
  ``ack_flush_interval=0``).

* Ids: ``message.id`` is ``"<topic>/<entry id>"`` (what :meth:`publish` returns):
  unique across messages and streams, and kept by every redelivery (a retry copy
  carries the original id in a header), or the id a publisher set in that header.
* Entries that cannot be decoded (a field name that is not UTF-8, a ``headers`` field
  that is not a JSON object of strings, a library header of the wrong type) are
  dead-lettered on their own with a reason; the dead letter's body holds the raw
  fields as JSON ``[name, value]`` pairs (bytes decoded with ``surrogateescape``).
  The rest of the batch is delivered.
* Lifecycle: after :meth:`close` (which flushes queued acks or raises
  :class:`~msgpatterns.errors.BrokerError`), every operation raises
  :class:`~msgpatterns.errors.BrokerClosed` at once and nothing reconnects. A fetch
  blocked in XREADGROUP when :meth:`close` is called is woken (CLIENT UNBLOCK) and
  hands back anything it read, so nothing stays pending under the closed consumer.
* Errors: a connection failure that outlasts the reconnect attempts raises
  :class:`~msgpatterns.errors.BrokerUnavailable` (auth failures at once, never
  retried), any other Redis error :class:`~msgpatterns.errors.BrokerError`; the
  redis-py exception is the ``__cause__``.
* A lost consumer group (a Redis without persistence restarted empty, or
  ``XGROUP DESTROY``) is re-created with MKSTREAM at ``0`` and consumption resumes;
  the loss is logged as an error (its pending deliveries are gone with it; the
  stream's surviving entries are read again: at least once, never lost).

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
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from msgpatterns._callables import renamed_arguments
from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers._adapter import BrokerAdapter
from msgpatterns.brokers._batch import outgoing
from msgpatterns.brokers._reconnect import reconnect_backoff, reconnecting
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    MalformedMessage,
)
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MessageTooLarge,
    check_max_message_bytes,
    oversize_reason,
)
from msgpatterns.message import Message, delivered

redis = require("redis", "redis")

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.redis_streams import RedisStreamsDeadLetters

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)
_AUTH_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthorizationError)

__all__ = ["RedisStreamsBroker"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a RedisStreamsBroker"

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


class _Receipt(NamedTuple):
    """Where one delivery sits: its stream entry, in ``group``. A tuple: the read loop
    builds one per entry with ``tuple.__new__`` (no Python frame)."""

    stream: str
    entry_id: str
    group: str
    topic: str
    retry: bool


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _ack_commands(batch: Sequence[_Receipt]) -> list[tuple[Any, ...]]:
    """The commands that settle ``batch``: one XACK per stream and group (plus an XDEL
    of retry-stream entries, which are never read again once acked)."""
    first = batch[0]
    stream, group, retry = first.stream, first.group, first.retry
    for r in batch:  # the common case: every ack is for one stream and group
        if r.stream != stream or r.group != group or r.retry is not retry:
            break
    else:
        ids = [r.entry_id for r in batch]
        if retry:
            return [("XACK", stream, group, *ids), ("XDEL", stream, *ids)]
        return [("XACK", stream, group, *ids)]
    by_stream: dict[tuple[str, str, bool], list[str]] = {}
    for r in batch:
        by_stream.setdefault((r.stream, r.group, r.retry), []).append(r.entry_id)
    commands: list[tuple[Any, ...]] = []
    for (stream, group, retry), ids in by_stream.items():
        commands.append(("XACK", stream, group, *ids))
        if retry:
            commands.append(("XDEL", stream, *ids))
    return commands


def _pack(parts: Sequence[bytes]) -> bytes:
    """Netstrings the _PROMOTE script unpacks."""
    return b"".join(b"%d:%s" % (len(p), p) for p in parts)


def _id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``"<ms>-<seq>"``) as something that sorts like it."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def note_seen(seen: dict[tuple[str, str], str], stream: str, group: str,
              entry_id: Any) -> None:
    """Raise ``seen[(stream, group)]`` to ``entry_id`` (the last id of a read)."""
    eid = codec.text(entry_id)
    slot = (stream, group)
    before = seen.get(slot)
    if before is None or _id_order(eid) > _id_order(before):
        seen[slot] = eid


def mark_lost(seen: Mapping[tuple[str, str], str], reread: dict[tuple[str, str], str],
              streams: Mapping[str, str], group: str) -> None:
    """A read of ``streams`` (stream -> id read from) lost its reply: what it read of
    each stream read with ``>`` is above the highest id seen so far, pending under this
    consumer; read it again from there (a stream already being read again keeps its
    place)."""
    for stream, start in streams.items():
        if start == ">":
            reread.setdefault((stream, group), seen.get((stream, group), "0-0"))


def reread_done(reply: Any, reread: dict[tuple[str, str], str], streams: Mapping[str, str],
                group: str) -> list[tuple[str, str]]:
    """After a read of ``streams``, move on the places of the streams it read again
    (their own pending entries): to the last id the reply holds, or forgotten when it
    held none (all read again). Returns the (stream, id) of entries deleted while
    pending (the reply has no fields for them): to be acked, nothing can deliver them."""
    if not any(start != ">" for start in streams.values()):
        return []
    last: dict[str, str] = {}
    deleted: list[tuple[str, str]] = []
    for stream_name, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
        stream = codec.text(stream_name)
        if streams.get(stream, ">") == ">" or not entries:
            continue
        last[stream] = codec.text(entries[-1][0])
        deleted.extend((stream, codec.text(eid)) for eid, fields in entries if fields is None)
    for stream, start in streams.items():
        if start == ">":
            continue
        if stream in last:
            reread[(stream, group)] = last[stream]
        else:
            reread.pop((stream, group), None)
    return deleted


_OWN_PENDING_BATCH = 500


def own_pending(client: Any, stream: str, group: str,
                consumer: str) -> list[tuple[Any, Any, int]]:
    """Up to 500 deliveries pending under ``consumer`` (oldest first) as (entry id,
    fields, delivery count): XPENDING for the ids and counts, then XCLAIM to the same
    consumer for the fields (an entry deleted meanwhile leaves the pending list there)."""
    pending = client.xpending_range(stream, group, min="-", max="+",
                                    count=_OWN_PENDING_BATCH, consumername=consumer)
    return _with_fields(pending, client.xclaim(stream, group, consumer, 0,
                                               [p["message_id"] for p in pending])
                        if pending else [])


async def own_pending_async(client: Any, stream: str, group: str,
                            consumer: str) -> list[tuple[Any, Any, int]]:
    """:func:`own_pending` on a ``redis.asyncio`` client."""
    pending = await client.xpending_range(stream, group, min="-", max="+",
                                          count=_OWN_PENDING_BATCH, consumername=consumer)
    if not pending:
        return []
    return _with_fields(pending, await client.xclaim(
        stream, group, consumer, 0, [p["message_id"] for p in pending]))


def _with_fields(pending: list[dict[str, Any]], claimed: Any) -> list[tuple[Any, Any, int]]:
    counts = {codec.text(p["message_id"]): int(p["times_delivered"]) for p in pending}
    return [(entry_id, fields, counts.get(codec.text(entry_id), 1))
            for entry_id, fields in claimed or () if fields is not None]


class _Malformed(ValueError):
    """An entry that cannot become a Message (the text says why)."""


class _NoGroup(BrokerError):
    """Redis answered NOGROUP: the consumer group (or its stream) is gone."""


def redis_error(exc: BaseException, where: str, closed: bool = False) -> BrokerError:
    """The library's error for redis-py's ``exc`` (which becomes its cause): refused
    credentials and unreachable servers are :class:`BrokerUnavailable` (a call cut by
    ``close()`` is :class:`BrokerClosed`), NOGROUP is the adapter's lost-group signal,
    anything else a :class:`BrokerError`."""
    if isinstance(exc, _AUTH_ERRORS):
        return BrokerUnavailable(f"redis refused the credentials ({where}): {exc}")
    if isinstance(exc, _CONNECTION_ERRORS):
        if closed:
            return BrokerClosed(f"{where} was closed during a redis call")
        return BrokerUnavailable(f"redis unreachable ({where}): {exc}")
    if isinstance(exc, redis.ResponseError):
        if "NOGROUP" in str(exc):  # also inside a script's error text
            return _NoGroup(str(exc))
        return BrokerError(f"redis refused a command ({where}): {exc}")
    return BrokerError(f"redis call failed ({where}): {exc}")


def client_from(url: Any, factory: Any) -> tuple[Any, bool]:
    """The client for ``url`` (a URL: a new one from ``factory.from_url``, which the
    caller owns and closes; else ``url`` is a client already, shared) and whether the
    caller owns it."""
    if isinstance(url, str):
        return factory.from_url(url), True
    return url, False


def _pairs(raw: Any) -> list[tuple[Any, Any]]:
    """An entry's raw fields (a dict from XREADGROUP, a flat list from a script)."""
    if isinstance(raw, dict):
        return list(raw.items())
    return [(raw[i], raw[i + 1]) for i in range(0, len(raw) - 1, 2)]


def _fields(raw: Any) -> dict[str, Any]:
    """An entry's fields by name; raises :class:`_Malformed` for a name that is not
    UTF-8 (never a lossy decode: two names must not become one)."""
    out: dict[str, Any] = {}
    for name, value in _pairs(raw):
        if isinstance(name, bytes):
            try:
                name = name.decode("utf-8")
            except UnicodeDecodeError:
                raise _Malformed(f"field name {name[:50]!r} is not UTF-8") from None
        out[str(name)] = value
    return out


def _raw_fields_body(raw: Any) -> bytes:
    """The raw fields as JSON ``[name, value]`` pairs, bytes decoded with
    ``surrogateescape`` (lossless: ``s.encode("utf-8", "surrogateescape")``)."""
    def txt(v: Any) -> str:
        return v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)
    return json.dumps([[txt(k), txt(v)] for k, v in _pairs(raw)]).encode()


@dataclass(eq=False, slots=True)
class _Read:
    """A fetch in progress: the Redis client id of the connection it blocks on."""

    client_id: int | None = None


@dataclass(eq=False, slots=True)
class _Ahead:
    """An XREADGROUP sent ahead of the fetch that takes it: its connection, with the
    replies of ``acks`` ack commands and then the read's reply still to come.
    ``acked``: the deliveries those commands ack (queued again if the replies never
    come: the acks may not have reached Redis)."""

    conn: Any
    key: tuple[tuple[str, ...], str]
    origin: dict[str, tuple[str, bool]]
    acks: int
    since: float
    acked: list[_Receipt]


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
        self._settle_script = self._redis.register_script(_SETTLE)
        self._promote_script = self._redis.register_script(_PROMOTE)
        self._claim_script = self._redis.register_script(_CLAIM)
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


class RedisStreamsBroker(StreamsSettings, BrokerAdapter):
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on Redis Streams.

    Recovery time after a consumer dies: its deliveries become claimable
    ``visibility_timeout`` seconds after their last delivery; the next fetch that looks
    (at most ``claim_interval`` later) claims a batch, and every following fetch claims
    another while stale entries remain (a fetch returns claimed deliveries first), so
    the backlog comes back at the rate the consumer processes it: about
    ``visibility_timeout + claim_interval + orphans / processing rate``. At the
    defaults (30 min, 30 s) and 1,000 messages/s, 5,000 orphans are back about 30.5
    minutes after the crash, 5 s of which is the backlog itself.

    Args:
        url: a ``redis://`` URL, or a ``redis.Redis`` client (shared; not closed by
            :meth:`close`). The old keyword ``client_or_url=`` still works.
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
        ack_batch: queued acks that wake the flusher at once (a backstop: a fetch
            takes every queued ack along with its read).
        promote_interval: how often a fetch moves due delayed retries into the retry
            stream (seconds; a retry is at most this late).
        read_ahead: read the next batch ahead under a backlog (see the module
            docstring).
        read_ahead_hold: seconds a read-ahead no fetch takes stays pending under this
            consumer before the flusher hands it back.
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
        ack_flush_interval: float = 0.05,
        ack_batch: int = 1024,
        promote_interval: float = 0.05,
        read_ahead: bool = True,
        read_ahead_hold: float = 1.0,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._configure(url, redis.Redis, locals())  # the options, by their names
        self._lock = threading.Lock()
        self._overflow: list[Message] = []
        self.read_ahead = read_ahead
        self.read_ahead_hold = read_ahead_hold
        #: Reads sent ahead, by (topics, group); None while one is being sent.
        self._aheads: dict[tuple[tuple[str, ...], str], _Ahead | None] = {}
        self._last_read = float("-inf")  # monotonic time of the last read
        self._read_conns: list[Any] = []  # pool connections kept by reads
        self._closed = threading.Event()
        #: ``_closed.is_set()`` as a plain attribute (read per ack), set with it.
        self._closing = False
        self._retrying = reconnecting(
            _CONNECTION_ERRORS, logger=log, what="redis call", attempts=5,
            backoff=reconnect_backoff(2.0), until=self._closed,
        )
        self.ack_flush_interval = ack_flush_interval
        self.ack_batch = max(1, ack_batch)
        self._acks: list[_Receipt] = []
        self._ack_lock = threading.Lock()
        self._ack_full = threading.Event()  # wakes the flusher (full batch, close)
        self._flusher: threading.Thread | None = None
        self._flush_error: Exception | None = None
        self._fetches: set[_Read] = set()
        self._fetches_done = threading.Condition(self._lock)

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

    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        """Add a message to stream ``topic``; its id is ``"<topic>/<entry id>"``."""
        fields = self._entry(payload, codec.wire_headers(headers, key=key))
        entry_id = self._call(
            self._redis.xadd, topic, fields, maxlen=self.maxlen, approximate=True
        )
        return self.message_id(topic, codec.text(entry_id))

    def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Add ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key and
        headers) to stream ``topic`` in one MULTI/EXEC round trip; returns their ids in
        order, as :meth:`publish` would.

        All or nothing: Redis adds the whole batch in one transaction, or none of it
        when the transaction fails (:class:`~msgpatterns.errors.BrokerError`, nothing
        added). As with :meth:`publish`, a reply lost with a dropped connection is
        retried, which can add the batch twice (at least once, never partly)."""
        self._check_open()
        entries = [self._entry(body_bytes(item.body),
                               codec.wire_headers(item.headers, key=item.key))
                   for item in outgoing(items)]
        if not entries:
            return []

        def send() -> Any:
            pipe = self._redis.pipeline(transaction=True)
            for fields in entries:
                pipe.xadd(topic, fields, maxlen=self.maxlen, approximate=True)
            return pipe.execute()

        return [self.message_id(topic, codec.text(e)) for e in self._call(send)]

    @staticmethod
    def message_id(topic: str, entry_id: str) -> str:
        """The id of the message at ``entry_id`` of stream ``topic``: entry ids are
        unique only within a stream, so the stream name is part of it."""
        return f"{topic}/{entry_id}"

    def subscribe(self, topic: str, group: str) -> None:
        """Create ``group`` on ``topic`` now (a fetch does it otherwise)."""
        self._check_open()
        self._ensure_groups([topic], group)

    def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                       timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries: stale ones claimed from dead consumers,
        due retries, then new entries (waiting up to ``timeout`` seconds).

        A :meth:`close` from another thread wakes a waiting fetch: it hands back what
        it read and raises :class:`~msgpatterns.errors.BrokerClosed`."""
        read = _Read()
        with self._lock:
            self._check_open()
            self._fetches.add(read)
        try:
            out = self._fetch(topics, group, max_messages, timeout, read)
            with self._lock:
                closing = self._closed.is_set()
            if closing:  # close() ran meanwhile: nothing read now reaches a handler
                self._hand_back(out)
                raise BrokerClosed(f"{self!r} was closed during the fetch")
            return out
        finally:
            with self._lock:
                self._fetches.discard(read)
                self._fetches_done.notify_all()

    def _fetch(self, topics: Sequence[str], group: str, max_messages: int,
               timeout: float, read: _Read) -> list[Message]:
        self._ensure_groups(topics, group)
        acks = self._take_acks()  # sent with the read below: one round trip for both
        try:
            out = self._take_overflow(topics, group, max_messages)
            wait = timeout
            now = time.monotonic()
            for topic in topics:
                slot = (topic, group)
                if now >= self._promote_at.get(slot, 0.0):
                    self._recovering(topics, group, self._promote, topic, group,
                                     max(max_messages, 100), now)
                due = self._next_due.get(slot)
                if due is not None:  # block no longer than until a known retry is due
                    wait = min(wait, max(0.0, due - now))
            if len(out) < max_messages:
                out.extend(self._recovering(topics, group, self._claim_stale, topics,
                                            group, max_messages - len(out)))
            remaining = max_messages - len(out)
            if remaining <= 0:
                if acks:
                    self._send_acks(acks)
                return out
            block = None if out or wait <= 0 else max(1, int(wait * 1000))
            got = self._recovering(topics, group, self._read, topics, group, remaining,
                                   block, read, acks)
        except BaseException:
            self._requeue_acks(acks)  # sent or not: an XACK sent twice is harmless
            raise
        out.extend(got[:remaining])
        if len(got) > remaining:
            with self._lock:
                self._overflow.extend(got[remaining:])
        return out

    def ack(self, message: Message) -> None:
        """Queue the ack (see the batching note above); :meth:`flush` sends it now."""
        receipt = message.delivery.receipt
        if type(receipt) is not _Receipt:
            receipt = receipt_of(message, _Receipt, _OWNER)  # raises the usual error
        if self.ack_flush_interval <= 0:
            self._queue_acks((receipt,))
            return
        with self._ack_lock:  # _queue_acks inlined: the hot path of every message
            if self._closing:  # under the lock: close() flushes what got queued
                self._check_open()  # raises BrokerClosed
            acks = self._acks
            acks.append(receipt)
            if len(acks) >= self.ack_batch or self._flusher is None:
                self._wake_flusher()

    def ack_many(self, messages: Sequence[Message]) -> None:
        """:meth:`ack` for many deliveries at once (one lock, one queue append)."""
        receipts = [message.delivery.receipt for message in messages]
        if set(map(type, receipts)) != {_Receipt}:  # C speed; empty or a stranger
            for message in messages:
                receipt_of(message, _Receipt, _OWNER)  # raises the usual error
        self._queue_acks(receipts)

    def _queue_acks(self, receipts: Sequence[_Receipt]) -> None:
        """Send the acks now (no batching) or queue them for the next fetch (which
        sends them in the same write as its read) or the flusher thread, whichever
        comes first."""
        if self.ack_flush_interval <= 0:
            self._check_open()
            self._send_acks(receipts)
            return
        with self._ack_lock:
            self._check_open()  # under the lock: close() flushes whatever got queued
            self._acks.extend(receipts)
            if len(self._acks) >= self.ack_batch or self._flusher is None:
                self._wake_flusher()

    def _wake_flusher(self) -> None:
        """Ack lock held: start the flusher thread, or wake it to send a full batch now
        (off the caller's thread: a fetch coming first takes the batch along)."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_periodically,
                                             name=f"{self.consumer}-acks", daemon=True)
            self._flusher.start()
        if len(self._acks) >= self.ack_batch:
            self._ack_full.set()

    def _take_acks(self) -> list[_Receipt]:
        with self._ack_lock:
            batch, self._acks = self._acks, []
        return batch

    def _requeue_acks(self, batch: list[_Receipt]) -> None:
        """Put back acks taken by a fetch that failed before they surely reached Redis
        (even after close(): it flushes them once the fetch has ended)."""
        if batch:
            with self._ack_lock:
                self._acks[:0] = batch

    def flush(self) -> None:
        """Send every queued ack to Redis now."""
        self._check_open()
        self._flush()

    def _flush(self) -> None:
        batch = self._take_acks()
        if batch:
            self._send_acks(batch)

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds, to this group only, with ``attempt + 1``,
        the original payload and the message's headers as they are now."""
        self._check_open()
        self._redeliver(message, delay)

    def _redeliver(self, message: Message, delay: float, attempt: int | None = None) -> None:
        """Move the delivery to the retry path (the delayed set when ``delay`` > 0)."""
        r = receipt_of(message, _Receipt, _OWNER)
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
        self._check_open()
        self._bury(message, record)

    def _bury(self, message: Message, record: DeadLetter) -> None:
        r = receipt_of(message, _Receipt, _OWNER)
        fields = self._entry(codec.dead_letter_body(record), codec.dead_letter_headers(record))
        moved = self._move(r, self.dead_letter_stream(r.topic), "stream", fields,
                           maxlen=self.dead_letter_maxlen)
        if not moved:
            log.debug("dead letter of %s ignored: claimed by another consumer", message.id)

    def close(self) -> None:
        """Stop, settle and release; idempotent.

        Guarantees, in order: no operation starts any more (each raises
        :class:`~msgpatterns.errors.BrokerClosed`); a fetch waiting in XREADGROUP is
        woken and hands back what it read; deliveries read but never returned by
        :meth:`fetch` are handed back (their attempt unchanged); queued acks are sent;
        then every delivery still pending under this consumer is handed back to its
        group's retry stream, where any consumer of the group reads it at once (its
        attempt unchanged: the delivery count Redis keeps): deliveries a consumer
        fetched and did not settle before ``close()`` - not run yet, or whose
        handler's settlement came after ``close()`` and was refused - never wait for
        ``visibility_timeout``; the connection pool is released if this broker
        created it. If handing back or
        sending acks fails, the pool is still released and the error is raised
        (:class:`~msgpatterns.errors.BrokerError`): those deliveries come back after
        ``visibility_timeout``, none is lost. Nothing reconnects afterwards.
        """
        with self._lock:
            if self._closed.is_set():
                return
            self._closing = True
            self._closed.set()
        self._ack_full.set()
        try:
            self._wake_fetches()
            with self._lock:
                unused, self._overflow = self._overflow, []
            try:
                try:
                    self._hand_back_ahead()
                finally:
                    self._hand_back(unused)
            finally:  # the acks go out even if a hand-back failed
                if self._flusher is not None:
                    self._flusher.join(timeout=5)
                try:
                    self._flush()
                    if self._flush_error is not None:  # the flusher's last batch failed
                        raise self._flush_error
                finally:
                    self._hand_back_pending()
        finally:
            while self._read_conns:
                self._redis.connection_pool.release(self._read_conns.pop())
            if self._owns_client:
                self._redis.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _wake_fetches(self, patience: float = 10.0) -> None:
        """Unblock fetches waiting in XREADGROUP (CLIENT UNBLOCK, so the reply is never
        lost on a killed socket) and wait until they have handed back what they read."""
        give_up = time.monotonic() + patience
        while True:
            with self._lock:
                ids = [f.client_id for f in self._fetches if f.client_id is not None]
                if not self._fetches:
                    return
            if time.monotonic() > give_up:
                log.error("%s: a fetch did not end within %gs of close()", self.consumer,
                          patience)
                return
            try:  # again each round: an unblock sent before the read blocked is a no-op
                for client_id in ids:
                    self._do(self._redis.client_unblock, client_id)
            except BrokerError:
                log.warning("%s: could not unblock a fetch", self.consumer, exc_info=True)
            with self._lock:
                if self._fetches:
                    self._fetches_done.wait(0.01)

    def _hand_back(self, messages: Sequence[Message]) -> None:
        """Return deliveries that no handler saw, their attempt unchanged."""
        for message in messages:
            self._redeliver(message, 0.0, attempt=message.attempt)

    def _hand_back_pending(self) -> None:
        """:meth:`close`: hand back every delivery still pending under this consumer in
        the groups it used (see :func:`own_pending`). Redis unreachable: logged, and
        those deliveries come back after ``visibility_timeout`` (none is lost)."""
        with self._lock:
            slots = sorted(self._origins.items())
        try:
            for (stream, group), (topic, retry) in slots:
                first = None
                while True:
                    entries = self._do(own_pending, self._redis, stream, group,
                                       self.consumer)
                    if not entries or entries[0][0] == first:  # none, or none could move
                        break
                    first = entries[0][0]
                    for entry_id, fields, deliveries in entries:
                        message = self._message(topic, stream, retry, group, entry_id,
                                                fields, deliveries)
                        if message is not None:
                            self._redeliver(message, 0.0, attempt=message.attempt)
        except BrokerError:
            log.warning("%s: could not hand back the deliveries pending under this "
                        "consumer on close(); they come back after visibility_timeout",
                        self.consumer, exc_info=True)

    # -- dead-letter admin ----------------------------------------------------------

    def dead_letter_admin(self) -> RedisStreamsDeadLetters:
        """The admin of ``<topic>:dlq`` streams, on this broker's client and retries."""
        from msgpatterns.brokers.admin.redis_streams import RedisStreamsDeadLetters

        return RedisStreamsDeadLetters(self._redis, call=self._call)

    # -- internals --------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`_do`, refused at once after :meth:`close`."""
        self._check_open()
        return self._do(fn, *args, **kwargs)

    def _do(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried with backoff if the connection fails (never
        once closed); redis-py's exceptions come out as the library's own."""
        try:
            try:
                return self._attempt(fn, args, kwargs)
            except _CONNECTION_ERRORS as exc:
                if self._closed.is_set():
                    raise BrokerClosed(f"{self!r} was closed during a redis call") from exc
                log.warning("redis call failed; retrying", exc_info=True)
                return self._retrying(self._attempt, fn, args, kwargs, retrying=True)
        except BrokerError:
            raise
        except redis.RedisError as exc:
            raise redis_error(exc, repr(self), self._closed.is_set()) from exc

    def _attempt(self, fn: Any, args: Any, kwargs: Any, retrying: bool = False) -> Any:
        if retrying and self._closed.is_set():  # a closed broker never reconnects
            raise BrokerClosed(f"{self!r} is closed")
        try:
            return fn(*args, **kwargs)
        except _AUTH_ERRORS as exc:  # never retried as if transient
            raise redis_error(exc, repr(self)) from exc

    def _recovering(self, topics: Sequence[str], group: str, fn: Any, *args: Any,
                    **kwargs: Any) -> Any:
        """``fn(*args)``; if the group is gone (NOGROUP), re-create it and call again."""
        try:
            return fn(*args, **kwargs)
        except _NoGroup:
            with self._lock:
                self._groups -= {g for g in self._groups if g[1] == group}
            self._ensure_groups(topics, group, lost=True)
            return fn(*args, **kwargs)

    def _flush_periodically(self) -> None:
        while not self._closed.is_set():
            self._ack_full.wait(self.ack_flush_interval)
            self._ack_full.clear()  # before taking the batch: a later set is seen
            if self._closed.is_set():
                return  # close() sends what is left
            try:
                self._flush()
                if self._aheads:
                    self._hand_back_ahead(older_than=self.read_ahead_hold)
            except Exception as exc:
                if self._closed.is_set():  # close() is waiting: it raises this
                    self._flush_error = exc
                    return
                log.exception("%s: sending acks failed; those messages will be "
                              "redelivered", self.consumer)

    def _send_acks(self, batch: Sequence[_Receipt]) -> None:
        """One round trip: XACK per stream (and XDEL for retry-stream entries).
        XACK is idempotent and an acked retry entry is never read again (reads take
        new entries only), so these need no MULTI/EXEC around them."""
        self._do(self._send_commands, _ack_commands(batch))

    @staticmethod
    def _entry(body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        fields: dict[str, Any] = {"body": body}
        if headers:
            fields["headers"] = codec.dumps_headers(headers)
        return fields

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

    def _read(self, topics: Sequence[str], group: str, count: int,
              block: int | None, read: _Read,
              acks: Sequence[_Receipt] = ()) -> list[Message]:
        """XREADGROUP of new entries; the queued ``acks`` go in the same write (one
        round trip for both).

        Read-ahead: when a read fills ``count`` (a backlog) less than a quarter of
        ``read_ahead_hold`` after the previous read (a consumer keeping up), the next
        XREADGROUP (without BLOCK) is written at once, with the acks queued by then,
        and its reply left for the next fetch, so Redis prepares the next batch while
        the handlers run. Those entries are this consumer's pending deliveries like any
        others: the next fetch takes them, :meth:`close` hands back what no fetch
        took, and so does the flusher thread when no fetch took them within
        ``read_ahead_hold`` seconds (a consumer stopped without closing its
        broker). Once entries are read, nothing here raises: a failure to send the
        acks puts them back in the queue."""
        streams: dict[str, str] = {}
        origin: dict[str, tuple[str, bool]] = {}
        for topic in topics:
            retry_key = self.retry_stream(topic, group)
            streams[retry_key] = ">"
            streams[topic] = ">"
            origin[retry_key] = (topic, True)
            origin[topic] = (topic, False)
        head: list[Any] = ["XREADGROUP", "GROUP", group, self.consumer, "COUNT", count]
        tail = ["STREAMS", *streams, *streams.values()]
        key = (tuple(topics), group)
        got: list[Message] = []
        ahead = self._take_ahead(key)
        if ahead is not None:
            got = self._messages(self._finish_ahead(ahead), ahead.origin, group)
        if not got:
            reply, deleted = self._do(self._read_own_first, head, streams, group, block,
                                      read, _ack_commands(acks) if acks else ())
            acks = ()
            if deleted:
                self._ack_deleted(deleted, origin, group)
            got = self._messages(reply, origin, group)
        now = time.monotonic()
        steady, self._last_read = now - self._last_read < self.read_ahead_hold / 4, now
        if (steady and len(got) >= count and self.read_ahead
                and self.ack_flush_interval > 0 and not self._reread
                and self._send_ahead(key, origin, acks, head + tail)):
            return got
        if acks:
            try:
                self._send_acks(acks)
            except Exception:  # the entries are read: hand them out, ack later
                log.warning("%s: sending acks failed; queued again", self.consumer,
                            exc_info=True)
                self._requeue_acks(list(acks))
        return got

    def _read_own_first(self, head: list[Any], streams: Mapping[str, str], group: str,
                        block: int | None, read: _Read,
                        acks: Sequence[tuple[Any, ...]]) -> tuple[Any, list[tuple[str, str]]]:
        """One XREADGROUP: of this consumer's own pending entries from where a lost
        reply left them (see :func:`mark_lost`), for the streams that have some, and of
        new entries for the others; BLOCK only when it reads new entries alone. A reply
        lost on the wire marks its streams to be read again (the retry of this call does
        that). Returns the raw reply and the entries deleted while pending."""
        reread = self._reread
        ids = {stream: reread.get((stream, group), ">") for stream in streams}
        again = any(start != ">" for start in ids.values())
        args = [*head, *(["BLOCK", block] if block is not None and not again else ()),
                "STREAMS", *ids, *ids.values()]
        try:
            reply = self._read_on_own_connection(args, read, acks)
        except _CONNECTION_ERRORS:
            mark_lost(self._seen, reread, ids, group)
            raise
        return reply, reread_done(reply, reread, ids, group) if again else []

    def _ack_deleted(self, deleted: Sequence[tuple[str, str]],
                     origin: Mapping[str, tuple[str, bool]], group: str) -> None:
        """Ack own pending entries that were deleted (trimmed) meanwhile: nothing can
        deliver them any more."""
        log.error("%s: %d pending entries were trimmed before being processed: %s",
                  group, len(deleted), deleted[:10])
        self._send_acks([_Receipt(stream, eid, group, *origin[stream])
                         for stream, eid in deleted])

    def _take_ahead(self, key: tuple[tuple[str, ...], str]) -> _Ahead | None:
        """The read sent ahead for ``key``, now the caller's (None if there is none,
        or it is still being sent)."""
        with self._lock:
            ahead = self._aheads.get(key)
            if ahead is None:
                return None
            del self._aheads[key]
            return ahead

    def _send_ahead(self, key: tuple[tuple[str, ...], str],
                    origin: dict[str, tuple[str, bool]], acks: Sequence[_Receipt],
                    read: list[Any]) -> bool:
        """Write the ``acks`` and then ``read`` on a connection kept until a fetch
        (or :meth:`close`, or the flusher) reads their replies. False, and nothing
        sent, when ``key`` has a read-ahead already (several consumers sharing this
        broker) or the write failed."""
        with self._lock:
            if self._closed.is_set() or key in self._aheads:
                return False
            self._aheads[key] = None  # reserved
        conn = self._take_conn()
        commands = [*(_ack_commands(acks) if acks else ()), read]
        try:
            conn.send_packed_command(conn.pack_commands(commands))
        except Exception:
            self._give_conn(conn, broken=True)
            with self._lock:
                self._aheads.pop(key, None)
            # the read may have reached Redis: what it read is to be read again
            mark_lost(self._seen, self._reread, dict.fromkeys(origin, ">"), key[1])
            log.warning("%s: read-ahead failed", self.consumer, exc_info=True)
            return False
        with self._lock:
            self._aheads[key] = _Ahead(conn, key, origin, len(commands) - 1,
                                       time.monotonic(), list(acks))
        if self._flusher is None:  # it hands back a read-ahead no fetch takes
            with self._ack_lock:
                self._wake_flusher()
        return True

    def _finish_ahead(self, ahead: _Ahead) -> Any:
        """The reply of a read sent ahead (None if it failed: its entries come back
        after ``visibility_timeout``, at least once)."""
        conn = ahead.conn
        try:
            refused: BaseException | None = None
            for _ in range(ahead.acks):
                try:
                    conn.read_response()
                except redis.ResponseError as exc:
                    refused = exc
            if refused is not None:
                log.error("%s: redis refused acks (%s); those messages will be "
                          "redelivered", self.consumer, refused)
            reply = conn.read_response()
        except Exception:
            self._give_conn(conn, broken=True)
            self._requeue_acks(ahead.acked)  # sent or not: an XACK sent twice is harmless
            # what it read is pending under this consumer: the next read reads it again
            mark_lost(self._seen, self._reread, dict.fromkeys(ahead.origin, ">"),
                      ahead.key[1])
            log.warning("%s: reading a read-ahead failed; its acks are queued again and "
                        "its entries are read again by the next fetch", self.consumer,
                        exc_info=True)
            return None
        self._give_conn(conn)
        return reply

    def _hand_back_ahead(self, older_than: float | None = None) -> None:
        """Read the read-aheads no fetch took (at all, or within ``older_than``
        seconds) and hand their deliveries back."""
        now = time.monotonic()
        with self._lock:
            stale = [a for a in self._aheads.values() if a is not None and
                     (older_than is None or now - a.since >= older_than)]
            for ahead in stale:
                del self._aheads[ahead.key]
        for ahead in stale:
            self._hand_back(self._messages(self._finish_ahead(ahead), ahead.origin,
                                           ahead.key[1]))

    def _take_conn(self) -> Any:
        """A connection for a read: one an earlier read kept, or a pool connection
        (reads keep theirs: no pool round per fetch)."""
        try:
            return self._read_conns.pop()
        except IndexError:
            pass
        pool = self._redis.connection_pool
        try:
            return pool.get_connection()
        except TypeError:  # redis-py < 5.3 wants a command name
            return pool.get_connection("XREADGROUP")

    def _give_conn(self, conn: Any, broken: bool = False) -> None:
        """Keep ``conn`` for the next read, or give it back to the pool (``broken``:
        disconnected first, a reply may still be on the way; or closed)."""
        if broken:
            conn.disconnect()
        if broken or self._closed.is_set():
            self._redis.connection_pool.release(conn)
        else:
            self._read_conns.append(conn)

    def _send_commands(self, commands: Sequence[Sequence[Any]]) -> None:
        """One round trip for ``commands`` (no MULTI/EXEC)."""
        if len(commands) == 1:
            self._redis.execute_command(*commands[0])
            return
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        pipe.execute()

    def _messages(self, reply: Any, origin: Mapping[str, tuple[str, bool]],
                  group: str) -> list[Message]:
        """The deliveries in an XREADGROUP reply as redis-py's connection hands it back
        before any response callback (RESP2: ``[[stream, entries]...]``, RESP3:
        ``{stream: entries}``; an entry is ``[id, [name, value, ...]]``, or
        ``[id, None]`` when it was deleted while pending).

        One tight loop: an entry of a single ``body`` field (what :meth:`publish`
        writes without headers) becomes a Message here at once; any other entry goes
        through :meth:`_message` (headers, foreign producers, malformed entries, which
        are dead-lettered on their own while the rest are delivered)."""
        out: list[Message] = []
        if not reply:
            return out
        append = out.append
        slow = self._message
        receipt = _Receipt
        new_receipt = tuple.__new__
        make = delivered
        # Entries added in the same millisecond share its timestamp: ``ms`` is that
        # millisecond's id prefix (b"<ms>-"), tested without building anything.
        ms, timestamp = b"-", 0.0
        seen = self._seen
        # Bodies above this go through ``slow`` (which dead-letters them): one
        # comparison per entry, no bound is sys.maxsize.
        most = self.max_message_bytes or sys.maxsize
        for stream_name, entries in reply.items() if isinstance(reply, dict) else reply:
            stream = stream_name if type(stream_name) is str else codec.text(stream_name)
            topic, retry = origin[stream]
            prefix = topic + "/"
            if entries:  # the highest id read (a lost reply is read again above it)
                note_seen(seen, stream, group, entries[-1][0])
            # Taken off the reply one by one, so each entry's lists are freed as soon
            # as its Message exists: fewer live objects for the garbage collector to
            # scan and promote while the batch is built.
            entries.reverse()
            pop = entries.pop
            while entries:
                entry_id, fields = pop()
                if fields is None:  # deleted (trimmed) while pending
                    continue
                if (type(entry_id) is bytes and type(fields) is list and len(fields) == 2
                        and fields[0] == b"body" and type(fields[1]) is bytes
                        and len(fields[1]) <= most):
                    if not entry_id.startswith(ms):
                        head = entry_id.partition(b"-")[0]
                        ms, timestamp = head + b"-", int(head) / 1000
                    eid = entry_id.decode("ascii")
                    append(make(fields[1], prefix + eid, topic, timestamp,
                                new_receipt(receipt, (stream, eid, group, topic, retry))))
                    continue
                message = slow(topic, stream, retry, group, entry_id, fields, 1)
                if message is not None:
                    append(message)
        return out

    def _read_on_own_connection(self, args: list[Any], read: _Read,
                                acks: Sequence[tuple[Any, ...]] = ()) -> Any:
        """``acks`` then XREADGROUP on a pool connection whose client id :meth:`close`
        knows, so it can wake it with CLIENT UNBLOCK (the reply, entries or none,
        always arrives). The acks and CLIENT ID go in the same write as the read: one
        round trip. The XREADGROUP reply is returned raw (no response callback).

        An ack Redis refuses is logged (that delivery is redelivered after
        ``visibility_timeout``: at least once) and does not fail the read."""
        conn = self._take_conn()
        refused: BaseException | None = None
        try:
            conn.send_packed_command(conn.pack_commands([*acks, ("CLIENT", "ID"), args]))
            for _ in acks:
                try:
                    conn.read_response()
                except redis.ResponseError as exc:
                    refused = exc
            read.client_id = int(conn.read_response())
            reply = conn.read_response()
        except BaseException:
            read.client_id = None
            self._give_conn(conn, broken=True)  # a reply may still be on the way
            raise
        read.client_id = None
        self._give_conn(conn)
        if refused is not None:
            log.error("%s: redis refused acks (%s); those messages will be redelivered",
                      self.consumer, refused)
        return reply

    def _message(self, topic: str, stream: str, retry: bool, group: str, entry_id: Any,
                 raw: Any, deliveries: int) -> Message | None:
        """The delivery as a Message; an entry that cannot be one is dead-lettered
        (with its raw fields and the reason) and None returned; so is an entry over
        ``max_message_bytes`` (with its raw body and the reason)."""
        limit = self.max_message_bytes
        if type(raw) is dict and len(raw) == 1 and type(entry_id) is bytes:
            body = raw.get(b"body")
            if type(body) is bytes and (limit is None or len(body) <= limit):
                # the common case (a body, no headers), kept cheap
                eid = entry_id.decode("ascii")
                message = Message(body, id=f"{topic}/{eid}", topic=topic,
                                  timestamp=int(eid.partition("-")[0]) / 1000,
                                  attempt=deliveries)
                message.receipt = _Receipt(stream, eid, group, topic, retry)
                return message
        eid = codec.text(entry_id)
        receipt = _Receipt(stream, eid, group, topic, retry)
        try:
            fields = _fields(raw)
            body = fields.get("body")
            oversize = oversize_reason(
                body, [(k, v) for k, v in fields.items() if k != "body"], limit=limit)
            if oversize is not None:
                self._bury_malformed(topic, receipt, raw, deliveries, oversize,
                                     too_large=True,
                                     body=None if body is None else _b(body))
                return None
            if body is None:  # an entry from a producer that does not use msgpatterns
                body = json.dumps({k: codec.text(v) for k, v in fields.items()}).encode()
                raw_headers = None
            else:
                raw_headers = fields.get("headers")
        except _Malformed as exc:
            self._bury_malformed(topic, receipt, raw, deliveries, str(exc))
            return None
        timestamp = int(eid.split("-", 1)[0]) / 1000
        if raw_headers is None:  # the common case, kept cheap
            message = Message(_b(body), id=self.message_id(topic, eid), topic=topic,
                              timestamp=timestamp, attempt=deliveries)
        else:
            try:
                t = codec.split_transport(codec.parse_headers(raw_headers))
            except ValueError as exc:
                self._bury_malformed(topic, receipt, raw, deliveries, str(exc))
                return None
            message = Message(
                _b(body),
                id=t.id or self.message_id(topic, eid),
                key=t.key,
                topic=topic,
                headers=t.headers,
                timestamp=t.timestamp or timestamp,
                attempt=codec.attempt_of(t.headers, deliveries - 1),
            )
        message.receipt = receipt
        return message

    def _bury_malformed(self, topic: str, receipt: _Receipt, raw: Any, deliveries: int,
                        problem: str, *, too_large: bool = False,
                        body: bytes | None = None) -> None:
        """Dead-letter one entry no handler gets: its raw fields as the body (or its raw
        ``body`` field when given: an oversized entry is not encoded again), the reason.
        ``too_large``: ``problem`` is an :mod:`~msgpatterns.limits` reason."""
        message = Message(_raw_fields_body(raw) if body is None else body,
                          id=self.message_id(topic, receipt.entry_id), topic=topic,
                          attempt=max(1, deliveries))
        message.receipt = receipt
        held = ("its raw fields as JSON [name, value] pairs" if body is None
                else "its raw body field")
        what = "oversized" if too_large else "undecodable"
        reason = (f"{what} Redis stream entry {receipt.entry_id} of {receipt.stream}:"
                  f" {problem}; the body holds {held}")
        error = MessageTooLarge(reason) if too_large else MalformedMessage(reason)
        log.error("%s: %s", self.consumer, escape_control(reason))
        self._bury(message, DeadLetter.from_error(
            message, error, now=time.time(), reason=reason, group=receipt.group))

    def _take_overflow(self, topics: Sequence[str], group: str, limit: int) -> list[Message]:
        with self._lock:
            if not self._overflow:
                return []
            taken: list[Message] = []
            kept: list[Message] = []
            for m in self._overflow:
                r = receipt_of(m, _Receipt, _OWNER)
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
        result = self._recovering([r.topic], r.group, self._do,
            self._settle_script,
            keys=[r.stream, target],
            args=[r.group, self.consumer, r.entry_id, "1" if r.retry else "0", mode,
                  delay_ms, "" if maxlen is None else maxlen, *values],
        )
        return bool(result)


    def __repr__(self) -> str:
        return f"RedisStreamsBroker(consumer={self.consumer!r})"
