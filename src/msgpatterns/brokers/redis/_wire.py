"""The Redis Streams wire core: key names, entry fields, the Lua scripts, receipts, the
read bookkeeping and the decoding of an entry into a Message. No client library:
redis-py is the adapters' business (:mod:`._link`); what is here is shared by the
sync adapter, the asyncio adapter, the dead-letter admin and the raw loop, so they
read and write the same entries.

Keys, for a stream ``S`` (a topic) and a consumer group ``G``: ``S`` (every group reads
all of it), ``S:retry:G`` (redeliveries meant for ``G`` only), ``S:delayed:G`` (a sorted
set of ``G``'s delayed retries, scored by due time), ``S:dlq`` (dead letters of every
group, each entry carrying the full record).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from msgpatterns import headers as h
from msgpatterns._escape import escape_control
from msgpatterns.brokers import codec
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import MalformedMessage
from msgpatterns.limits import MessageTooLarge, oversize_reason
from msgpatterns.message import Message

__all__ = [
    "CLAIM",
    "PROMOTE",
    "SETTLE",
    "EntryDecoder",
    "Malformed",
    "Receipt",
    "ack_commands",
    "dead_letter_stream",
    "delayed_set",
    "entry",
    "entry_fields",
    "entry_pairs",
    "id_order",
    "mark_lost",
    "message_id",
    "note_seen",
    "pack",
    "raw_fields_body",
    "reread_done",
    "retry_stream",
    "to_bytes",
]

log = logging.getLogger("msgpatterns.brokers.redis")

# Move one delivery of this consumer to a target (a stream, or the delayed set) and ack
# it, atomically. Does nothing when the delivery is no longer this consumer's.
# KEYS: source stream, target. ARGV: group, consumer, entry id, delete source ('1'/'0'),
# 'zset' | 'stream', delay ms, maxlen ('' for none), then the fields (zset: one member).
SETTLE = """
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
PROMOTE = """
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
CLAIM = """
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


# -- key names and ids -----------------------------------------------------------------


def retry_stream(topic: str, group: str) -> str:
    """The stream of ``group``'s redeliveries of ``topic``."""
    return f"{topic}:retry:{group}"


def delayed_set(topic: str, group: str) -> str:
    """The sorted set of ``group``'s delayed retries of ``topic``."""
    return f"{topic}:delayed:{group}"


def dead_letter_stream(topic: str) -> str:
    """The dead-letter stream of ``topic``."""
    return f"{topic}:dlq"


def message_id(topic: str, entry_id: str) -> str:
    """The id of the message at ``entry_id`` of stream ``topic``: entry ids are unique
    only within a stream, so the stream name is part of it."""
    return f"{topic}/{entry_id}"


class Receipt(NamedTuple):
    """Where one delivery sits: its stream entry, in ``group``. A tuple: the read loop
    builds one per entry with ``tuple.__new__`` (no Python frame)."""

    stream: str
    entry_id: str
    group: str
    topic: str
    retry: bool


# -- entries -------------------------------------------------------------------------


def to_bytes(value: Any) -> bytes:
    """A field value as Redis stores it."""
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def entry(body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
    """The fields of an entry: ``body``, and ``headers`` as JSON when there are any."""
    fields: dict[str, Any] = {"body": body}
    if headers:
        fields["headers"] = codec.dumps_headers(headers)
    return fields


def pack(parts: Sequence[bytes]) -> bytes:
    """Netstrings the :data:`PROMOTE` script unpacks."""
    return b"".join(b"%d:%s" % (len(p), p) for p in parts)


def ack_commands(batch: Sequence[Receipt]) -> list[tuple[Any, ...]]:
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


class Malformed(ValueError):
    """An entry that cannot become a Message (the text says why)."""


def entry_pairs(raw: Any) -> list[tuple[Any, Any]]:
    """An entry's raw fields (a dict from XREADGROUP, a flat list from a script)."""
    if isinstance(raw, dict):
        return list(raw.items())
    return [(raw[i], raw[i + 1]) for i in range(0, len(raw) - 1, 2)]


def entry_fields(raw: Any) -> dict[str, Any]:
    """An entry's fields by name; raises :class:`Malformed` for a name that is not
    UTF-8 (never a lossy decode: two names must not become one)."""
    out: dict[str, Any] = {}
    for name, value in entry_pairs(raw):
        if isinstance(name, bytes):
            try:
                name = name.decode("utf-8")
            except UnicodeDecodeError:
                raise Malformed(f"field name {name[:50]!r} is not UTF-8") from None
        out[str(name)] = value
    return out


def raw_fields_body(raw: Any) -> bytes:
    """The raw fields as JSON ``[name, value]`` pairs, bytes decoded with
    ``surrogateescape`` (lossless: ``s.encode("utf-8", "surrogateescape")``)."""
    def txt(v: Any) -> str:
        return v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)
    return json.dumps([[txt(k), txt(v)] for k, v in entry_pairs(raw)]).encode()


# -- what a consumer has read ----------------------------------------------------------


def id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``"<ms>-<seq>"``) as something that sorts like it."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def note_seen(seen: dict[tuple[str, str], str], stream: str, group: str,
              entry_id: Any) -> None:
    """Raise ``seen[(stream, group)]`` to ``entry_id`` (the last id of a read)."""
    eid = codec.text(entry_id)
    slot = (stream, group)
    before = seen.get(slot)
    if before is None or id_order(eid) > id_order(before):
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


# -- decoding --------------------------------------------------------------------------


class EntryDecoder:
    """An entry as a Message, without I/O: an entry that cannot be one (or is over
    ``max_message_bytes``) becomes a dead letter handed to ``bury(message, record)``
    (with its raw fields, or its raw ``body`` field when oversized, and the reason) and
    no Message. The sync adapter buries at once; the async one collects them and sends
    them after its fetch. An attempt header beyond the group's ``bounds`` is ignored
    (XPENDING's delivery count is kept: :func:`msgpatterns.brokers.codec.attempt_of`)."""

    __slots__ = ("bounds", "bury", "consumer", "max_message_bytes")

    def __init__(self, consumer: str, max_message_bytes: int | None,
                 bury: Callable[[Message, DeadLetter], None],
                 bounds: Callable[[str], h.WireBounds] | None = None) -> None:
        self.consumer = consumer
        self.max_message_bytes = max_message_bytes
        self.bury = bury
        #: A group's policy bounds on the library's headers (the adapter's
        #: ``wire_bounds``; None: the library's limits).
        self.bounds = bounds

    def message(self, topic: str, stream: str, retry: bool, group: str, entry_id: Any,
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
                message.receipt = Receipt(stream, eid, group, topic, retry)
                return message
        eid = codec.text(entry_id)
        receipt = Receipt(stream, eid, group, topic, retry)
        try:
            fields = entry_fields(raw)
            body = fields.get("body")
            oversize = oversize_reason(
                body, [(k, v) for k, v in fields.items() if k != "body"], limit=limit)
            if oversize is not None:
                self.bury_malformed(topic, receipt, raw, deliveries, oversize,
                                    too_large=True,
                                    body=None if body is None else to_bytes(body))
                return None
            if body is None:  # an entry from a producer that does not use msgpatterns
                body = json.dumps({k: codec.text(v) for k, v in fields.items()}).encode()
                raw_headers = None
            else:
                raw_headers = fields.get("headers")
        except Malformed as exc:
            self.bury_malformed(topic, receipt, raw, deliveries, str(exc))
            return None
        timestamp = int(eid.split("-", 1)[0]) / 1000
        if raw_headers is None:  # the common case, kept cheap
            message = Message(to_bytes(body), id=message_id(topic, eid), topic=topic,
                              timestamp=timestamp, attempt=deliveries)
        else:
            try:
                t = codec.split_transport(codec.parse_headers(raw_headers))
            except ValueError as exc:
                self.bury_malformed(topic, receipt, raw, deliveries, str(exc))
                return None
            message = Message(
                to_bytes(body),
                id=t.id or message_id(topic, eid),
                key=t.key,
                topic=topic,
                headers=t.headers,
                timestamp=t.timestamp or timestamp,
                attempt=codec.attempt_of(t.headers, deliveries - 1, h.WIRE_LIMITS
                                         if self.bounds is None else self.bounds(group)),
            )
        message.receipt = receipt
        return message

    def bury_malformed(self, topic: str, receipt: Receipt, raw: Any, deliveries: int,
                       problem: str, *, too_large: bool = False,
                       body: bytes | None = None) -> None:
        """Dead-letter one entry no handler gets: its raw fields as the body (or its raw
        ``body`` field when given: an oversized entry is not encoded again), the reason.
        ``too_large``: ``problem`` is an :mod:`~msgpatterns.limits` reason."""
        message = Message(raw_fields_body(raw) if body is None else body,
                          id=message_id(topic, receipt.entry_id), topic=topic,
                          attempt=max(1, deliveries))
        message.receipt = receipt
        held = ("its raw fields as JSON [name, value] pairs" if body is None
                else "its raw body field")
        what = "oversized" if too_large else "undecodable"
        reason = (f"{what} Redis stream entry {receipt.entry_id} of {receipt.stream}:"
                  f" {problem}; the body holds {held}")
        error = MessageTooLarge(reason) if too_large else MalformedMessage(reason)
        log.error("%s: %s", self.consumer, escape_control(reason))
        self.bury(message, DeadLetter.from_error(
            message, error, now=time.time(), reason=reason, group=receipt.group))
