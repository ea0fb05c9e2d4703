"""What the broker adapters (and the integrations) put on the wire, shared by all of them.

Every adapter moves the same things through its broker: a message body (bytes), the
message's string headers, a few *transport* headers that carry what a broker has no
field for (the stable message id, the business key, the original publish time, the
consumer group a retry is meant for, when it is due), and dead-letter records. Keeping
the encoding here means a record written by one adapter reads the same in all of them
and in ``msgpatterns dlq``.

Guarantees:

* :func:`redelivery_headers` keeps the failure history the runtime wrote and sets the
  next attempt number, so the attempt count survives redelivery and restarts.
* :func:`dead_letter_headers` plus :func:`dead_letter_body` hold the full
  :class:`~msgpatterns.DeadLetter` record (original body, headers, topic, attempts,
  first/last failure time, error type, message and traceback, reason, group) and
  :func:`read_dead_letter` rebuilds it.
* :func:`replay_headers` resets the attempt count and drops the failure history while
  keeping the user's own headers.
* Trace context (W3C ``traceparent``) travels here, in one place for every adapter:
  while telemetry is on (:func:`msgpatterns.observability.instrument`), a published
  message gets the current context, a redelivered or dead-lettered one its
  delivery's; a ``traceparent`` already in the headers (the original publisher's) is
  never replaced. While it is off nothing is added.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from msgpatterns import headers as h
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs

__all__ = [
    "GROUP",
    "KEY",
    "MESSAGE_ID",
    "PARKED",
    "REMOVES",
    "TIMESTAMP",
    "TRACEBACK",
    "Transport",
    "attempt_of",
    "dead_letter_body",
    "dead_letter_headers",
    "dumps_headers",
    "loads_headers",
    "parse_headers",
    "read_dead_letter",
    "redelivery_headers",
    "removal_marker_headers",
    "removed_positions",
    "replay_headers",
    "split_transport",
    "text",
    "user_headers",
    "wire_headers",
]

#: The message id, stable across retries (brokers that re-publish a retry give the copy
#: a new broker id; this header keeps the original).
MESSAGE_ID = h.PREFIX + "message-id"
#: The business key, on brokers without a key field.
KEY = h.PREFIX + "key"
#: The original publish time (seconds since the epoch) of a re-published message.
TIMESTAMP = h.PREFIX + "timestamp"
#: The consumer group a retry or a dead letter belongs to.
GROUP = h.PREFIX + "group"
#: The last error's traceback, on a dead letter.
TRACEBACK = h.PREFIX + "traceback"
#: A retry copy whose first delivery only parks it until it is due (NATS JetStream).
PARKED = h.PREFIX + "parked"
#: On a dead-letter-topic marker record (Kafka, which cannot delete records): the
#: positions of the dead letters it removes, as JSON ``[[partition, offset], ...]``.
REMOVES = h.PREFIX + "dlq-removes"

_TRANSPORT = (MESSAGE_ID, KEY, TIMESTAMP, GROUP, h.RETRY_DUE_AT)
_FAILURE_STATE = (
    h.ATTEMPT, h.FIRST_FAILED_AT, h.LAST_FAILED_AT, h.ERROR_TYPE, h.ERROR_MESSAGE,
    h.DEAD_LETTER_REASON, h.ORIGINAL_TOPIC, h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET,
    TRACEBACK,
)
_TRACEBACK_LIMIT = 16_000


def text(value: Any) -> str:
    """A header value as text (brokers hand back bytes, numbers or strings)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", errors="replace")
    return value if isinstance(value, str) else str(value)


def dumps_headers(headers: Mapping[str, str]) -> str:
    """Headers as one JSON string (for brokers whose entries are flat field lists)."""
    return json.dumps(dict(headers), separators=(",", ":"), sort_keys=True)


def loads_headers(raw: str | bytes | None) -> dict[str, str]:
    """The inverse of :func:`dumps_headers`; anything but a JSON object reads as empty."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to decode
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): text(v) for k, v in data.items()}


def parse_headers(raw: str | bytes | None) -> dict[str, str]:
    """The strict twin of :func:`loads_headers`, for headers that came off the wire.

    Guarantees: returns a ``dict[str, str]`` or raises ``ValueError`` whose text says
    what is wrong (not UTF-8 JSON, not an object, a value that is not a string, one of
    the library's numeric headers that is not a finite number, an attempt out of
    range: :func:`msgpatterns.headers.header_problem`), so
    an adapter can dead-letter that one message with the reason instead of guessing.
    """
    if raw is None:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: too deep
        raise ValueError(f"the headers field is not UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the headers field is JSON {type(data).__name__}, not an object")
    bad = sorted(str(k) for k, v in data.items() if not isinstance(v, str))
    if bad:
        raise ValueError(f"header values must be strings; not for {bad[:5]}")
    problem = h.header_problem(data)
    if problem is not None:
        raise ValueError(problem)
    return dict(data)


@dataclass(frozen=True, slots=True)
class Transport:
    """The transport headers of an incoming message, split from the user's headers."""

    headers: dict[str, str]
    id: str | None
    key: str | None
    timestamp: float | None
    group: str | None
    due_at: float | None


def split_transport(raw: Mapping[str, Any] | Iterable[tuple[str, Any]],
                    drop: Iterable[str] = ()) -> Transport:
    """Separate the transport headers from the headers a handler sees.

    ``drop`` names broker-internal headers to discard (``x-death``, ...).
    """
    items = raw.items() if isinstance(raw, Mapping) else raw
    dropped = set(drop)
    headers = {str(k): text(v) for k, v in items if k not in dropped and v is not None}
    transport = {name: headers.pop(name) for name in _TRANSPORT if name in headers}
    return Transport(
        headers=headers,
        id=transport.get(MESSAGE_ID) or None,
        key=transport.get(KEY),
        timestamp=h.header_float(transport, TIMESTAMP),
        group=transport.get(GROUP),
        due_at=h.header_float(transport, h.RETRY_DUE_AT),
    )


def attempt_of(headers: Mapping[str, str], redeliveries: int = 0,
               bounds: h.WireBounds = h.WIRE_LIMITS) -> int:
    """The durable attempt number: the library's attempt header, as far as the
    consumer's ``bounds`` trust it (:func:`msgpatterns.headers.trusted_attempt`), plus
    the broker's count of redeliveries of this copy (deliveries that ended without a
    settlement; the broker's own count, so never bounded)."""
    return h.trusted_attempt(headers, bounds) + max(0, redeliveries)


def wire_headers(
    headers: Mapping[str, str] | None,
    *,
    message_id: str | None = None,
    key: str | None = None,
    timestamp: float | None = None,
    group: str | None = None,
    due_at: float | None = None,
) -> dict[str, str]:
    """``headers`` plus the transport headers that are given."""
    out = {str(k): text(v) for k, v in (headers or {}).items()}
    if message_id is not None:
        out[MESSAGE_ID] = message_id
    if key is not None:
        out[KEY] = key
    if timestamp is not None:
        out[TIMESTAMP] = repr(float(timestamp))
    if group is not None:
        out[GROUP] = group
    if due_at is not None:
        out[h.RETRY_DUE_AT] = repr(float(due_at))
    _trace(out, None)
    return out


def _trace(out: dict[str, str], message: Message | None) -> None:
    """Add trace context to ``out`` (see the module docstring) if telemetry is on."""
    listener = _obs.listener
    if listener is not None:
        _obs.report(listener.inject, out, message)


def redelivery_headers(
    message: Message,
    *,
    group: str | None = None,
    due_at: float | None = None,
    with_id: bool = True,
    attempt: int | None = None,
    parked: bool = False,
) -> dict[str, str]:
    """Wire headers for the copy that redelivers ``message``: its headers as they are
    now (the failure history), the next attempt number (or ``attempt``: a message
    handed back unprocessed keeps its own), the original topic and position, and the
    transport headers that keep id, key and publish time. ``with_id=False`` leaves the
    id out (brokers with a native message-id field carry it there); ``parked`` marks a
    copy whose first delivery only waits for ``due_at``."""
    out = dict(message.headers)
    out[h.ATTEMPT] = str(message.attempt + 1 if attempt is None else attempt)
    out.setdefault(h.ORIGINAL_TOPIC, message.topic)
    if message.partition is not None:
        out.setdefault(h.ORIGINAL_PARTITION, str(message.partition))
    if message.offset is not None:
        out.setdefault(h.ORIGINAL_OFFSET, str(message.offset))
    if parked:
        out[PARKED] = "1"
    _trace(out, message)
    return wire_headers(
        out,
        message_id=message.id if with_id else None,
        key=message.key,
        timestamp=message.timestamp,
        group=group,
        due_at=due_at,
    )


def dead_letter_body(record: DeadLetter) -> bytes:
    """The dead message's original payload (what the broker delivered, not what a
    decoder made of it)."""
    return body_bytes(record.message.raw_body)


def dead_letter_headers(record: DeadLetter, *, with_id: bool = True) -> dict[str, str]:
    """The whole record as string headers (see :func:`read_dead_letter`);
    ``with_id=False`` leaves the message id out (for a native message-id field)."""
    m = record.message
    out = record.to_headers()
    out[TRACEBACK] = record.traceback[-_TRACEBACK_LIMIT:]
    if m.partition is not None:
        out.setdefault(h.ORIGINAL_PARTITION, str(m.partition))
    if m.offset is not None:
        out.setdefault(h.ORIGINAL_OFFSET, str(m.offset))
    for name, value in record.extra.items():
        out.setdefault(name, value)
    _trace(out, m)
    return wire_headers(
        out, message_id=m.id if with_id else None, key=m.key, timestamp=m.timestamp,
        group=record.group or None,
    )


def read_dead_letter(body: bytes, raw_headers: Mapping[str, Any], *, fallback_id: str,
                     fallback_topic: str = "", location: Mapping[str, str] | None = None,
                     ) -> DeadLetter:
    """Rebuild a record written with :func:`dead_letter_headers`.

    ``location`` (where the record sits in the dead-letter queue, e.g. its entry id)
    lands in ``DeadLetter.extra``.
    """
    t = split_transport(raw_headers)
    hd = t.headers
    attempts = max(1, h.header_int(hd, h.ATTEMPT, 1))
    last = h.header_float(hd, h.LAST_FAILED_AT) or 0.0
    first = h.header_float(hd, h.FIRST_FAILED_AT)
    message = Message(
        body,
        id=t.id or fallback_id,
        key=t.key,
        topic=hd.get(h.ORIGINAL_TOPIC) or fallback_topic,
        headers={k: v for k, v in hd.items() if k not in _RECORD_FIELDS},
        timestamp=t.timestamp,
        attempt=attempts,
        partition=h.header_int(hd, h.ORIGINAL_PARTITION, -1) if h.ORIGINAL_PARTITION in hd
        else None,
        offset=h.header_int(hd, h.ORIGINAL_OFFSET, -1) if h.ORIGINAL_OFFSET in hd else None,
    )
    return DeadLetter(
        message=message,
        error_type=hd.get(h.ERROR_TYPE, ""),
        error_message=hd.get(h.ERROR_MESSAGE, ""),
        traceback=hd.get(TRACEBACK, ""),
        attempts=attempts,
        first_failed_at=last if first is None else first,
        last_failed_at=last,
        reason=hd.get(h.DEAD_LETTER_REASON, ""),
        group=t.group or "",
        extra=dict(location or {}),
    )


# Headers that describe the dead letter rather than the message.
_RECORD_FIELDS = frozenset(
    {h.ERROR_TYPE, h.ERROR_MESSAGE, h.DEAD_LETTER_REASON, h.ATTEMPT, h.LAST_FAILED_AT,
     TRACEBACK, h.ORIGINAL_TOPIC, h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET}
)


def replay_headers(record: DeadLetter, *, group: str | None = None,
                   due_at: float | None = None, with_id: bool = True) -> dict[str, str]:
    """Wire headers for replaying a dead letter: the user's headers, the original id
    (unless ``with_id=False``: a native message-id field carries it), key and publish
    time, ``group`` and ``due_at`` when given, and no attempt count or failure history
    (attempts reset)."""
    m = record.message
    return wire_headers(user_headers(record), message_id=m.id if with_id else None, key=m.key,
                        timestamp=m.timestamp, group=group, due_at=due_at)


def user_headers(record: DeadLetter) -> dict[str, str]:
    """The dead message's own headers: without the attempt count and failure history
    (what a replay keeps, on brokers that carry headers as they are)."""
    return {k: v for k, v in record.message.headers.items() if k not in _FAILURE_STATE}


def removal_marker_headers(positions: Iterable[tuple[int, int]]) -> dict[str, str]:
    """Headers of a marker record that removes the dead letters at ``positions``
    (``(partition, offset)`` pairs) from later listings (see :func:`removed_positions`)."""
    return {REMOVES: json.dumps([[int(p), int(o)] for p, o in positions])}


def removed_positions(headers: Mapping[str, str]) -> list[tuple[str, str]] | None:
    """The ``(partition, offset)`` positions a marker record removes, as text; None
    when ``headers`` are not a marker's (an ordinary dead letter)."""
    raw = headers.get(REMOVES)
    if raw is None:
        return None
    return [(str(where[0]), str(where[1])) for where in json.loads(raw)]
