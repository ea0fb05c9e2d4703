"""The NATS JetStream wire core shared by the NATS parts (the JetStream session both
adapters run, the dead-letter admin): stream, subject and consumer
names, and a delivery's headers judged and decoded - deliver it, hand it back until it
is due, or dead-letter it with the reason. No client library: the adapter gives the
message's fields (data, headers, the stream's sequence and delivery count, the publish
time) and carries the verdict out with nats-py.

Names, for a topic ``T`` (a NATS subject) and a consumer group ``G``: stream
``stream_name(T)`` holds ``T``, ``T.__retry.G`` and ``T.__dlq``; durable consumers
``G`` and ``G__retry`` (``safe_name`` of the group).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from msgpatterns import headers as h
from msgpatterns.brokers import codec
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import MalformedMessage
from msgpatterns.limits import MessageTooLarge, oversize_reason
from msgpatterns.message import Message

__all__ = [
    "DROP",
    "PARKED",
    "SUBJECT",
    "Verdict",
    "dead_letter_subject",
    "judge",
    "malformed_letter",
    "retry_subject",
    "safe_name",
    "stream_name",
]

PARKED = codec.PARKED
#: A plain subject: tokens of letters, digits, ``-`` and ``_`` separated by dots.
SUBJECT = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")
#: JetStream's own headers, never shown to a handler.
DROP = ("Nats-Msg-Id", "Nats-Expected-Stream", "Nats-Expected-Last-Sequence")


def safe_name(text: str) -> str:
    """A JetStream stream or consumer name for ``text``: readable, and collision-free
    (a short digest is added whenever characters had to be replaced)."""
    cleaned = _NAME_UNSAFE.sub("_", text)
    if cleaned != text or len(cleaned) > 200:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        cleaned = f"{cleaned[:180]}-{digest}"
    return cleaned


def stream_name(topic: str) -> str:
    """The JetStream stream that holds ``topic``, its retries and dead letters."""
    return safe_name(topic)


def retry_subject(topic: str, group: str) -> str:
    """The subject of ``group``'s redeliveries of ``topic``."""
    return f"{topic}.__retry.{safe_name(group)}"


def dead_letter_subject(topic: str) -> str:
    """The subject of ``topic``'s dead letters."""
    return f"{topic}.__dlq"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a delivery: hand ``message`` out; or NAK it with ``wait``
    seconds of delay (a retry not due yet: the server brings it back then); or
    dead-letter it for ``problem`` (an :mod:`~msgpatterns.limits` reason when
    ``too_large``)."""

    message: Message | None = None
    wait: float | None = None
    problem: str | None = None
    too_large: bool = False


def judge(data: bytes, headers: Mapping[str, str] | None, *, topic: str, stream: str,
          sequence: int, deliveries: int, published: float | None, now: float,
          limit: int | None, bounds: h.WireBounds = h.WIRE_LIMITS) -> Verdict:
    """The verdict on one delivery of ``topic``: its ``data`` and ``headers``, its
    ``sequence`` in ``stream``, the server's count of its ``deliveries`` and its
    ``published`` time. Refused (dead-lettered): a delivery over ``limit`` bytes, or
    whose library headers are forged or corrupt (this one only). A retry parked until
    a due time counts no attempt for its parking. ``bounds``: the consumer group's
    policy bounds - an attempt header beyond them is ignored, a due time beyond them
    is due now (:mod:`msgpatterns.headers`); the server's delivery count is kept."""
    oversize = oversize_reason(data, headers, limit=limit)
    if oversize is not None:  # over max_message_bytes: this one only
        return Verdict(problem=oversize, too_large=True)
    problem = h.header_problem(headers or {}, now=now)
    if problem is not None:  # a forged or corrupt library header: this one only
        return Verdict(problem=problem)
    t = codec.split_transport(headers or {}, drop=DROP)
    parked = 1 if t.headers.pop(PARKED, None) else 0
    due_at = h.honoured_due_at(t.due_at, now, bounds)
    if due_at is not None:
        return Verdict(wait=due_at - now)
    redeliveries = max(0, deliveries - 1 - parked)
    return Verdict(message=Message(
        data,
        id=t.id or f"{stream}:{sequence}",
        key=t.key,
        topic=topic,
        headers=t.headers,
        timestamp=t.timestamp if t.timestamp is not None else published,
        attempt=codec.attempt_of(t.headers, redeliveries, bounds),
        offset=sequence,
    ))


def malformed_letter(data: bytes, headers: Mapping[str, str] | None, *, topic: str,
                     group: str, fallback_id: str, sequence: int, problem: str,
                     too_large: bool, now: float) -> DeadLetter:
    """The dead letter of a delivery :func:`judge` refused: its body and its user
    headers kept, the reason in the record."""
    t = codec.split_transport(headers or {}, drop=DROP)
    message = Message(
        data, id=t.id or fallback_id, key=t.key, topic=topic,
        headers={k: v for k, v in t.headers.items() if not k.startswith(h.PREFIX)},
        offset=sequence,
    )
    reason = f"{'oversized' if too_large else 'malformed'} message: {problem}"
    error = MessageTooLarge(problem) if too_large else MalformedMessage(problem)
    return DeadLetter.from_error(message, error, now=now, reason=reason, group=group)
