"""The :class:`DeadLetter` record and the stores that keep dead letters.

A dead letter keeps everything needed to understand and replay a message that will
not be retried again: the message itself (body, headers, topic, key), how many times
it was delivered, when it first and last failed, and the last error's type, text and
traceback.
"""

from __future__ import annotations

import base64
import json
import threading
import traceback as tb
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from msgpatterns import headers as h
from msgpatterns.errors import describe, printable
from msgpatterns.message import Message

__all__ = ["DeadLetter", "DeadLetterStore", "MemoryDeadLetterStore", "body_bytes"]


def body_bytes(body: Any) -> bytes:
    """The message body as bytes: bytes as-is, text as UTF-8, anything else as JSON."""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8")
    return json.dumps(body, default=str).encode("utf-8")


def format_traceback(error: BaseException) -> str:
    """The traceback of ``error`` as text; never raises (a fallback line instead)."""
    try:
        text = "".join(tb.format_exception(type(error), error, error.__traceback__))
    except Exception:
        text = f"<traceback of {type(error).__qualname__} could not be formatted>\n"
    return printable(text)


@dataclass(frozen=True)
class DeadLetter:
    """A message that will not be retried again, with the reason why."""

    message: Message
    error_type: str
    error_message: str
    traceback: str
    attempts: int
    first_failed_at: float
    last_failed_at: float
    reason: str = ""
    group: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_error(
        cls,
        message: Message,
        error: BaseException,
        *,
        now: float,
        reason: str = "",
        group: str = "",
    ) -> DeadLetter:
        """Build the record for ``message`` whose last attempt failed with ``error``.

        Never raises on account of the error: an exception whose ``str()`` fails gets a
        fallback text, and lone surrogates are escaped, so a dead letter can always be
        written.
        """
        first = h.header_float(message.headers, h.FIRST_FAILED_AT)
        text = describe(error)
        return cls(
            message=message,
            error_type=f"{type(error).__module__}.{type(error).__qualname__}",
            error_message=text,
            traceback=format_traceback(error),
            attempts=message.attempt,
            first_failed_at=now if first is None else first,
            last_failed_at=now,
            reason=printable(reason) if reason else text,
            group=group,
        )

    @property
    def id(self) -> str | None:
        """The dead message's id (None when the broker and publisher gave none)."""
        return self.message.id

    def to_headers(self) -> dict[str, str]:
        """The record as string headers (message headers plus the failure details)."""
        out = dict(self.message.headers)
        out.update(
            {
                h.ERROR_TYPE: self.error_type,
                h.ERROR_MESSAGE: self.error_message[:4000],
                h.DEAD_LETTER_REASON: self.reason[:4000],
                h.ATTEMPT: str(self.attempts),
                h.FIRST_FAILED_AT: repr(self.first_failed_at),
                h.LAST_FAILED_AT: repr(self.last_failed_at),
                h.ORIGINAL_TOPIC: self.message.topic,
            }
        )
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (the body base64-encoded)."""
        m = self.message
        return {
            "id": m.id,
            "key": m.key,
            "topic": m.topic,
            "group": self.group,
            "headers": dict(m.headers),
            "timestamp": m.timestamp,
            "partition": m.partition,
            "offset": m.offset,
            "body_b64": base64.b64encode(body_bytes(m.body)).decode("ascii"),
            "error_type": self.error_type,
            "error_message": self.error_message,
            "traceback": self.traceback,
            "attempts": self.attempts,
            "first_failed_at": self.first_failed_at,
            "last_failed_at": self.last_failed_at,
            "reason": self.reason,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeadLetter:
        """Rebuild a record written by :meth:`to_dict`."""
        message = Message(
            base64.b64decode(data["body_b64"]),
            id=data["id"],
            key=data.get("key"),
            topic=data.get("topic", ""),
            headers=data.get("headers") or {},
            timestamp=data.get("timestamp"),
            attempt=max(1, int(data.get("attempts", 1))),
            partition=data.get("partition"),
            offset=data.get("offset"),
        )
        return cls(
            message=message,
            error_type=data["error_type"],
            error_message=data["error_message"],
            traceback=data.get("traceback", ""),
            attempts=int(data["attempts"]),
            first_failed_at=float(data["first_failed_at"]),
            last_failed_at=float(data["last_failed_at"]),
            reason=data.get("reason", ""),
            group=data.get("group", ""),
            extra=data.get("extra") or {},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> DeadLetter:
        return cls.from_dict(json.loads(text))


@runtime_checkable
class DeadLetterStore(Protocol):
    """Somewhere dead letters are kept until a person looks at them."""

    def put(self, record: DeadLetter) -> None: ...


class MemoryDeadLetterStore:
    """A thread-safe list of dead letters, for tests and single processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[DeadLetter] = []

    def put(self, record: DeadLetter) -> None:
        with self._lock:
            self._records.append(record)

    @property
    def records(self) -> list[DeadLetter]:
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)
