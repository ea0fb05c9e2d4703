"""The AMQP wire core shared by the RabbitMQ parts (sync and asyncio adapters, the
dead-letter admin, the raw loop): queue names and arguments, retry-delay buckets, message
properties as plain fields, and a delivery decoded into a Message. No client library:
each part turns the property fields into its client's type (``pika.BasicProperties``,
``aio_pika.Message``) and gives the decoding duck-typed ``method`` (``redelivered``) and
``properties`` (``headers``, ``message_id``, ``timestamp``) objects.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from msgpatterns import headers as h
from msgpatterns.brokers import codec
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.errors import ConfigurationError, MalformedMessage, printable
from msgpatterns.message import Message

__all__ = [
    "BROKER_HEADERS",
    "DELIVERY_COUNT",
    "MAX_DELAY_MS",
    "attempt_from",
    "dead_letter_queue_arguments",
    "dead_letter_queue_name",
    "dead_letter_wire",
    "delay_bucket_ms",
    "delivery_count",
    "message_of",
    "message_of_plain",
    "optional_text",
    "message_properties",
    "redelivery_wire",
    "retry_queue_arguments",
    "retry_queue_name",
    "shortstr",
    "take_round_robin",
    "wire_text",
]

# Headers RabbitMQ adds that handlers have no use for.
BROKER_HEADERS = ("x-death", "x-delivery-count", "x-first-death-exchange",
                  "x-first-death-queue", "x-first-death-reason", "x-last-death-exchange",
                  "x-last-death-queue", "x-last-death-reason")
DELIVERY_COUNT = "x-delivery-count"
#: Deliveries whose headers are only these (or none) carry no library header: their
#: Message is built without splitting the transport headers (same result, less work).
ONLY_BROKER_HEADERS = frozenset(BROKER_HEADERS)
#: The longest retry delay a retry queue holds (RabbitMQ's TTL and ``x-expires`` are at
#: most 2^32-1 ms; this bucket plus the queue's one-minute expiry margin stays below).
MAX_DELAY_MS = 4_200_000_000
SHORTSTR = 255  # AMQP short strings (header names, message ids): at most 255 bytes


def delay_bucket_ms(delay: float) -> int:
    """``delay`` in milliseconds rounded *up* to two significant digits (at least 1):
    a retry is never early, at most ~10% late, and delays share few retry queues.

    Delays above :data:`MAX_DELAY_MS` (about 48.6 days, RabbitMQ's TTL limit) get that
    bucket. A negative, NaN or infinite delay raises
    :class:`~msgpatterns.errors.ConfigurationError`.
    """
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not (
        math.isfinite(delay) and delay >= 0
    ):
        raise ConfigurationError(f"a retry delay must be finite and >= 0 seconds: {delay!r}")
    if delay * 1000 >= MAX_DELAY_MS:
        return MAX_DELAY_MS
    ms = max(1, math.ceil(delay * 1000))
    if ms < 100:
        return ms
    step = int(10 ** (len(str(ms)) - 2))
    return min(MAX_DELAY_MS, -(-ms // step) * step)


def shortstr(value: str) -> str:
    """``value`` as an encodable AMQP short string (escaped, at most 255 bytes)."""
    data = printable(value).encode("utf-8")
    if len(data) <= SHORTSTR:
        return printable(value)
    return data[:SHORTSTR].decode("utf-8", errors="ignore")


def wire_text(value: Any) -> Any:
    """A header value as pika can always encode it (text escaped, anything else as is)."""
    return printable(value) if isinstance(value, str) else value


def optional_text(value: Any) -> str | None:
    """A property from the wire (str, or bytes that were not UTF-8) as text, or None."""
    if value is None:
        return None
    text = codec.text(value)
    return text or None


def delivery_count(value: Any, redelivered: bool) -> int:
    """The server's count of earlier deliveries of this copy, validated."""
    if value is None:
        return 1 if redelivered else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedMessage(
            f"header {DELIVERY_COUNT!r} must be a non-negative integer, got {value!r}"
        )
    return value


def attempt_from(headers: Mapping[str, str], redeliveries: int,
                 bounds: h.WireBounds = h.WIRE_LIMITS) -> int:
    """The durable attempt number; library headers that are out of range (an attempt
    that is not an integer in range, a time that is not a finite number) are refused:
    the message is dead-lettered with the reason (see
    :func:`msgpatterns.headers.header_problem`). An attempt header beyond the
    consumer's ``bounds`` is ignored; the server's ``redeliveries`` always count."""
    problem = h.header_problem(headers)
    if problem is not None:
        raise MalformedMessage(problem)
    return codec.attempt_of(headers, redeliveries, bounds)


def take_round_robin(buffers: Mapping[str, deque[Message]], queues: Sequence[str],
                     out: list[Message], limit: int) -> None:
    """Move buffered deliveries into ``out``, one per queue in turn, until ``out`` holds
    ``limit`` or every buffer is empty (so no queue starves the others)."""
    taking = True
    while taking and len(out) < limit:
        taking = False
        for queue in queues:
            buffer = buffers.get(queue)
            if buffer and len(out) < limit:
                out.append(buffer.popleft())
                taking = True


def retry_queue_arguments(queue: str, delay_ms: int, queue_type: str | None) -> dict[str, Any]:
    """The arguments of retry queue ``<queue>.retry.<delay_ms>``: that message TTL, then
    dead-lettered back to ``queue``; deleted a minute after its last use."""
    args: dict[str, Any] = {
        **({} if queue_type is None else {"x-queue-type": queue_type}),
        "x-message-ttl": delay_ms,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": queue,
        "x-expires": delay_ms + 60_000,
    }
    if queue_type == "quorum":  # at-least-once dead-lettering back to the queue
        args.update({"x-dead-letter-strategy": "at-least-once",
                     "x-overflow": "reject-publish"})
    return args


def dead_letter_queue_arguments(queue_type: str | None) -> dict[str, Any]:
    """A classic queue: dead letters are inspected by fetching and returning them,
    which a quorum queue's delivery limit would eventually punish."""
    return {} if queue_type is None else {"x-queue-type": "classic"}


def retry_queue_name(queue: str, delay_ms: int) -> str:
    """The retry queue of ``queue`` for one delay bucket."""
    return f"{queue}.retry.{delay_ms}"


def dead_letter_queue_name(queue: str) -> str:
    """The dead-letter queue of a group's ``queue``."""
    return f"{queue}.dlq"


def message_properties(message_id: str | None, headers: Mapping[str, str]
                       ) -> dict[str, Any]:
    """The fields of a message's properties (``message_id``, ``headers``,
    ``delivery_mode``, ``timestamp``; the keywords of ``pika.BasicProperties`` and of
    ``aio_pika.Message``) with every text made encodable (lone surrogates escaped,
    short strings cut to 255 bytes): pika can always encode them."""
    return {
        "message_id": None if message_id is None else shortstr(message_id),
        "headers": {shortstr(str(k)): wire_text(v) for k, v in headers.items()},
        "delivery_mode": 2,
        "timestamp": int(time.time()),
    }


def redelivery_wire(message: Message, group: str, attempt: int | None = None
                    ) -> tuple[bytes, dict[str, Any]]:
    """Payload and property fields of the copy that redelivers ``message`` to
    ``group``."""
    wire = codec.redelivery_headers(message, group=group, with_id=False, attempt=attempt)
    return body_bytes(message.raw_body), message_properties(message.id, wire)


def dead_letter_wire(record: DeadLetter) -> tuple[bytes, dict[str, Any]]:
    """Payload and property fields of the dead letter holding ``record``."""
    wire = codec.dead_letter_headers(record, with_id=False)
    return codec.dead_letter_body(record), message_properties(record.message.id, wire)


def message_of(topic: str, method: Any, properties: Any, body: bytes,
               bounds: h.WireBounds = h.WIRE_LIMITS) -> Message:
    """The Message of a delivery; raises MalformedMessage naming a bad header;
    ``bounds``: the consumer group's policy bounds on the library's headers.

    A delivery with no headers but the server's (most of them) skips the transport
    split: it carries no library header to read or check. Same result as
    :func:`message_of_plain` (tests/test_rabbitmq_fast_paths.py checks it on
    generated deliveries)."""
    raw = properties.headers
    if not raw:
        redeliveries = 1 if method.redelivered else 0
    elif type(raw) is dict and raw.keys() <= ONLY_BROKER_HEADERS:
        redeliveries = delivery_count(raw.get(DELIVERY_COUNT), bool(method.redelivered))
    else:
        return message_of_plain(topic, method, properties, body, bounds)
    timestamp = properties.timestamp
    return Message(
        body,
        id=optional_text(properties.message_id),
        topic=topic,
        timestamp=float(timestamp) if isinstance(timestamp, int) else None,
        attempt=1 + redeliveries,
    )


def message_of_plain(topic: str, method: Any, properties: Any, body: bytes,
                     bounds: h.WireBounds = h.WIRE_LIMITS) -> Message:
    """The Message of a delivery, every header split and checked (the plain twin of
    :func:`message_of`)."""
    raw = properties.headers or {}
    if not isinstance(raw, Mapping):
        raise MalformedMessage(f"headers are not a table: {type(raw).__name__}")
    redeliveries = delivery_count(raw.get(DELIVERY_COUNT), bool(method.redelivered))
    t = codec.split_transport(raw, drop=BROKER_HEADERS)
    timestamp = t.timestamp
    if timestamp is None and isinstance(properties.timestamp, int):
        timestamp = float(properties.timestamp)
    return Message(
        body,
        id=t.id or optional_text(properties.message_id),
        key=t.key,
        topic=topic,
        headers=t.headers,
        timestamp=timestamp,
        attempt=attempt_from(t.headers, redeliveries, bounds),
    )

