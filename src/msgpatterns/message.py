"""The :class:`Message` a handler receives: the value it reads, and its ack.

A message is a value (body, id, key, topic, headers, attempt...). How it was
delivered - the broker's receipt and the settle-once state - is its
:class:`~msgpatterns.delivery.Delivery`; ``message.ack()``, ``message.ack(error)`` and
``message.disable_auto_ack()`` delegate to it. A message is *settled* exactly once: by
the runtime when the handler returns (auto ack), by the handler's own
:meth:`Message.ack` (explicit ack, from any thread), by the handler raising, or by the
ack deadline. Whatever comes first wins; anything later is ignored with a warning and
never flips the outcome.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from msgpatterns.delivery import Delivery, SettleCallback

__all__ = ["Message", "SettleCallback", "delivered"]


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
        "_headers",
        "attempt",
        "body",
        "delivery",
        "id",
        "key",
        "local_retries",
        "offset",
        "partition",
        "raw_body",
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
        delivery: Delivery[Any] | None = None,
    ) -> None:
        if attempt < 1:
            raise ValueError(f"attempt starts at 1, got {attempt}")
        self.body = body
        #: The payload exactly as the broker delivered it, before any decoding.
        self.raw_body: Any = body
        self.id: str | None = id
        self.key = key
        self.topic = topic
        self._headers: dict[str, str] | None = dict(headers) if headers else None
        self.timestamp: float = time.time() if timestamp is None else timestamp
        self.attempt = attempt
        self.partition = partition
        self.offset = offset
        self.local_retries = 0
        #: How this message was delivered: the broker's receipt and the settle-once
        #: state (a message built by hand has an empty one).
        self.delivery: Delivery[Any] = Delivery(None) if delivery is None else delivery

    @property
    def headers(self) -> dict[str, str]:
        """String headers (a dict of the message's own: change it freely)."""
        headers = self._headers
        if headers is None:  # made on first use: most deliveries carry none
            headers = self._headers = {}
        return headers

    @headers.setter
    def headers(self, value: dict[str, str]) -> None:
        self._headers = value

    # -- the delivery ---------------------------------------------------------------

    @property
    def receipt(self) -> object:
        """The broker adapter's handle for this delivery (read it with
        :func:`msgpatterns.delivery.receipt_of`). An adapter sets it on the message it
        builds."""
        return self.delivery.receipt

    @receipt.setter
    def receipt(self, value: object) -> None:
        self.delivery.receipt = value

    # -- public acknowledgement API -------------------------------------------------

    def disable_auto_ack(self) -> None:
        """Take over acknowledgement: the handler (or any thread) must call :meth:`ack`.

        Call it before the handler returns. If the handler then raises, the delivery
        fails and a later ``ack`` is ignored with a warning. A message never acked is
        failed at its ``ack_timeout`` deadline.
        """
        self.delivery.disable_auto_ack()

    @property
    def auto_ack(self) -> bool:
        """True unless :meth:`disable_auto_ack` was called."""
        return self.delivery.auto_ack

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
        return self.delivery.settle(self, error, source="ack")

    @property
    def acked(self) -> bool:
        """True once this delivery is settled (with or without an error)."""
        return self.delivery.settled

    @property
    def ack_error(self) -> BaseException | None:
        """The error this delivery was settled with, or None."""
        return self.delivery.error

    @property
    def succeeded(self) -> bool:
        """True when the delivery was settled without an error."""
        delivery = self.delivery
        return delivery.settled and delivery.error is None

    # -- runtime side -----------------------------------------------------------------

    def bind(self, on_settle: SettleCallback | None) -> None:
        """Where the outcome goes (once) when this delivery is settled
        (:meth:`Delivery.bind <msgpatterns.delivery.Delivery.bind>`)."""
        self.delivery.bind(on_settle)

    def __repr__(self) -> str:
        return (
            f"Message(id={self.id!r}, key={self.key!r}, topic={self.topic!r}, "
            f"attempt={self.attempt}, local_retries={self.local_retries})"
        )


_new = object.__new__


def delivered(body: Any, id: str, topic: str, timestamp: float, receipt: object,
              attempt: int = 1) -> Message:
    """For broker adapters, per fetched entry: the :class:`Message` of a delivery
    with no headers, no key and no partition, its :class:`Delivery` holding
    ``receipt``. The same as ``Message(body, id=id, topic=topic, timestamp=timestamp,
    attempt=attempt, delivery=Delivery(receipt))`` without the argument checks (the
    adapter guarantees ``attempt >= 1``) and at a fraction of the cost."""
    delivery: Delivery[Any] = _new(Delivery)
    delivery.receipt = receipt
    delivery.auto_ack = True
    delivery.settled = False
    delivery.error = None
    delivery.sink = None
    message: Message = _new(Message)
    message.body = message.raw_body = body
    message.id = id
    message.key = None
    message.topic = topic
    message._headers = None
    message.timestamp = timestamp
    message.attempt = attempt
    message.partition = message.offset = None
    message.local_retries = 0
    message.delivery = delivery
    return message
