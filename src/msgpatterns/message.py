"""The :class:`Message` a handler receives, and its acknowledgement state.

A message is *settled* exactly once: by the runtime when the handler returns (auto
ack), by the handler's own :meth:`Message.ack` (explicit ack, from any thread), by the
handler raising, or by the ack deadline. Whatever comes first wins; anything later is
ignored with a warning and never flips the outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Message"]

log = logging.getLogger("msgpatterns.message")

#: Called once with ``(message, error)`` when a message is settled.
SettleCallback = Callable[["Message", "BaseException | None"], None]


class Message:
    """One delivery of a broker message.

    Attributes:
        body: the payload (bytes, or an already decoded object).
        id: the broker's message id (stable across redeliveries and duplicates).
        key: the business id; the default idempotency and ordering key. May be None.
        topic: topic, stream or queue the message came from.
        headers: string headers; the library keeps its durable retry state here.
        timestamp: when the message was published (seconds since the epoch).
        attempt: delivery number, 1 on first delivery. Durable: it comes from the
            broker's redelivery count or a header the library writes, never from memory.
        local_retries: in-process retries of this delivery so far.
        partition, offset: the broker position, where the broker has one.
    """

    __slots__ = (
        "_ack_error",
        "_auto_ack",
        "_handler_returned",
        "_lock",
        "_on_settle",
        "_settled",
        "attempt",
        "body",
        "headers",
        "id",
        "key",
        "local_retries",
        "offset",
        "partition",
        "raw_body",
        "receipt",
        "timestamp",
        "topic",
    )

    def __init__(
        self,
        body: Any,
        *,
        id: str | None = None,
        key: str | None = None,
        topic: str = "",
        headers: Mapping[str, str] | None = None,
        timestamp: float | None = None,
        attempt: int = 1,
        partition: int | None = None,
        offset: int | None = None,
    ) -> None:
        if attempt < 1:
            raise ValueError(f"attempt starts at 1, got {attempt}")
        self.body = body
        #: The payload exactly as the broker delivered it, before any decoding.
        self.raw_body: Any = body
        self.id: str | None = id
        self.key = key
        self.topic = topic
        self.headers: dict[str, str] = dict(headers) if headers else {}
        self.timestamp: float = time.time() if timestamp is None else timestamp
        self.attempt = attempt
        self.partition = partition
        self.offset = offset
        self.local_retries = 0
        #: Broker-specific delivery handle (a receipt, a delivery tag, a stream id...).
        self.receipt: Any = None
        self._lock = threading.Lock()
        self._auto_ack = True
        self._settled = False
        self._handler_returned = False
        self._ack_error: BaseException | None = None
        self._on_settle: SettleCallback | None = None

    # -- public acknowledgement API -------------------------------------------------

    def disable_auto_ack(self) -> None:
        """Take over acknowledgement: the handler (or any thread) must call :meth:`ack`.

        Call it before the handler returns. If the handler then raises, the delivery
        fails and a later ``ack`` is ignored with a warning. A message never acked is
        failed at its ``ack_timeout`` deadline.
        """
        self._auto_ack = False

    @property
    def auto_ack(self) -> bool:
        """True unless :meth:`disable_auto_ack` was called."""
        return self._auto_ack

    def ack(self, error: BaseException | None = None) -> bool:
        """Settle this delivery: success, or failure when ``error`` is given.

        Safe from any thread. The first settlement wins; a later call is ignored with a
        warning and returns False. An error goes through the retry policy exactly like
        an exception raised by the handler (``NeedRetry``, ``Reject``, ...).

        Raises ``TypeError`` (and settles nothing) unless ``error`` is None or an
        exception *instance*: ``ack("declined")`` or ``ack(ValueError)`` is a mistake.
        """
        if error is not None and not isinstance(error, BaseException):
            kind = f"the class {error.__name__}" if isinstance(error, type) \
                else f"a {type(error).__name__}"
            raise TypeError(
                f"Message.ack(error) takes None or an exception instance, got {kind}; "
                "e.g. ack(Reject('payment declined')) or ack(ValueError('...'))"
            )
        return self._settle(error, source="ack")

    @property
    def acked(self) -> bool:
        """True once this delivery is settled (with or without an error)."""
        return self._settled

    @property
    def ack_error(self) -> BaseException | None:
        """The error this delivery was settled with, or None."""
        return self._ack_error

    @property
    def succeeded(self) -> bool:
        """True when the delivery was settled without an error."""
        return self._settled and self._ack_error is None

    # -- runtime side ---------------------------------------------------------------

    def bind(self, on_settle: SettleCallback | None) -> None:
        """Register the callback run (once) when this delivery is settled."""
        self._on_settle = on_settle

    def handler_finished(self, error: BaseException | None) -> None:
        """Record the handler's outcome: settle on error, or on return under auto ack."""
        self._handler_returned = True
        if error is not None:
            self._settle(error, source="handler")
        elif self._auto_ack:
            self._settle(None, source="auto")

    def settle_quietly(self) -> bool:
        """Runtime side, for settling many successful deliveries at once: record that
        the handler returned and settle this delivery as a success WITHOUT calling the
        settle callback (the caller does that work for the whole batch). Only for
        auto ack. False, and nothing changes, when it was settled already."""
        with self._lock:
            self._handler_returned = True
            if self._settled:
                return False
            self._settled = True
            self._ack_error = None
            return True

    def expire(self, error: BaseException) -> bool:
        """Fail the delivery at its ack deadline; False if it was settled already."""
        return self._settle(error, source="deadline")

    def copy_for_retry(self, *, attempt: int | None = None, local: bool = False) -> Message:
        """A fresh, unsettled copy for another attempt with the same broker receipt.

        ``local=True``: an in-process retry (``local_retries + 1``). Otherwise a new
        attempt (``attempt``) held by the runtime, with ``local_retries`` back at 0.
        """
        clone = Message(
            self.raw_body,
            id=self.id,
            key=self.key,
            topic=self.topic,
            headers=self.headers,
            timestamp=self.timestamp,
            attempt=self.attempt if attempt is None else attempt,
            partition=self.partition,
            offset=self.offset,
        )
        clone.receipt = self.receipt
        clone.local_retries = self.local_retries + 1 if local else 0
        return clone

    def _settle(self, error: BaseException | None, *, source: str) -> bool:
        with self._lock:
            if self._settled:
                first = self._ack_error
                late = True
            else:
                self._settled = True
                self._ack_error = error
                late = False
                callback = self._on_settle
        if late:
            if source in ("ack", "handler"):
                log.warning(
                    "message %s: %s ignored, the delivery was already settled (%s)",
                    self.id,
                    "ack" if source == "ack" else f"handler error {error!r}",
                    "failed: " + repr(first) if first is not None else "acked",
                    extra={"message_id": self.id, "topic": self.topic,
                           "attempt": self.attempt},
                )
            return False
        if callback is not None:
            callback(self, error)
        return True

    def __repr__(self) -> str:
        return (
            f"Message(id={self.id!r}, key={self.key!r}, topic={self.topic!r}, "
            f"attempt={self.attempt}, local_retries={self.local_retries})"
        )
