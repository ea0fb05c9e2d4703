"""A :class:`Delivery`: one broker delivery of a message, as the runtime settles it.

A :class:`~msgpatterns.Message` is the value a handler reads; its delivery is the
handle the broker adapter and the runtime work with. The delivery owns:

* the adapter's **receipt** (a small typed record per adapter: a stream entry id, a
  delivery tag, a partition offset...), read back with :func:`receipt_of`;
* the **settle-once** state: a delivery is settled exactly once - by the runtime when
  the handler returns (auto ack), by the handler's ``message.ack()`` (explicit ack,
  from any thread), by the handler raising, or by the ack deadline. Whatever comes
  first wins; anything later is ignored with a warning and never flips the outcome;
* where the settled outcome goes: a ``sink(message, error)`` the runtime sets
  (:meth:`bind`); the sink is the runtime's settler, which turns the outcome into broker
  calls. The delivery reports the outcome and returns: it knows no consumer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from msgpatterns._escape import escape_control
from msgpatterns.errors import ConfigurationError

__all__ = ["Delivered", "Delivery", "SettleCallback", "receipt_of"]

log = logging.getLogger("msgpatterns.message")

R = TypeVar("R")


class Delivered(Protocol):
    """What a delivery reads of its message (a :class:`~msgpatterns.Message`; this
    module sits below it and names none of its other parts)."""

    @property
    def id(self) -> str | None: ...

    @property
    def topic(self) -> str: ...

    @property
    def attempt(self) -> int: ...

    @property
    def delivery(self) -> Delivery[Any]: ...


M = TypeVar("M", bound=Delivered)

#: Called once with ``(message, error)`` when a delivery is settled (the message: a
#: :class:`~msgpatterns.Message`).
SettleCallback = Callable[[Any, "BaseException | None"], None]


#: Guards the settle-once transition of EVERY delivery: a check-and-set of two
#: attributes per delivery, no call and no I/O while it is held, so one lock for all costs no
#: waiting worth the name and saves a lock object (and its allocation) per delivery.
_settle_lock = threading.Lock()


class Delivery(Generic[R]):
    """The receipt and the settle-once state of one delivery. Thread-safe: the
    settle-once check-and-set runs under one module-wide lock (held for a few
    attribute reads and writes only), so the first settlement wins on any thread.

    ``settled``, ``error`` and ``auto_ack`` are plain attributes for speed (the runtime
    reads them per message): read them, never assign them; :meth:`settle` and
    :meth:`disable_auto_ack` change them.
    """

    __slots__ = ("auto_ack", "error", "receipt", "settled", "sink")

    def __init__(self, receipt: R) -> None:
        #: The adapter's handle for this delivery (what ack/nack/dead_letter need).
        self.receipt = receipt
        #: False once the handler took over acknowledgement.
        self.auto_ack = True
        #: True once settled (with or without an error).
        self.settled = False
        #: The error the delivery was settled with, or None.
        self.error: BaseException | None = None
        #: Where the outcome goes, once, when the delivery is settled (:meth:`bind`).
        self.sink: SettleCallback | None = None

    def disable_auto_ack(self) -> None:
        """The handler acks itself (``message.ack()``)."""
        self.auto_ack = False

    # -- runtime side -------------------------------------------------------------------

    def bind(self, sink: SettleCallback | None) -> None:
        """Where the outcome goes (once) when this delivery is settled."""
        self.sink = sink

    @staticmethod
    def bind_all(messages: Iterable[Delivered], sink: SettleCallback | None) -> None:
        """:meth:`bind` each of ``messages``' deliveries to ``sink`` (a fetched batch)."""
        for message in messages:
            message.delivery.sink = sink

    def finish(self, message: Delivered, error: BaseException | None) -> None:
        """Record the handler's outcome: settle on error, or on return under auto ack."""
        if error is not None:
            self.settle(message, error, source="handler")
        elif self.auto_ack:
            # settle(message, None, source="auto") inlined: the hot path of every
            # successful run (a settled delivery ignores it quietly, as settle does).
            with _settle_lock:
                if self.settled:
                    return
                self.settled = True
                self.error = None
                sink = self.sink
            if sink is not None:
                sink(message, None)

    def settle_quietly(self) -> bool:
        """For settling many successful deliveries at once (their handler returned):
        settle as a success WITHOUT reporting to the sink (the caller does that work for
        the whole batch). Only for auto ack. False, and nothing changes, when it was
        settled already."""
        with _settle_lock:
            if self.settled:
                return False
            self.settled = True
            self.error = None
            return True

    @staticmethod
    def settle_all_quietly(messages: Iterable[M]) -> list[M]:
        """:meth:`settle_quietly` each of ``messages`` still under auto ack (one whose
        handler acks it itself is left alone, as :meth:`finish` leaves it); those it
        settled (in order)."""
        won: list[M] = []
        append = won.append
        with _settle_lock:  # once for the batch: a few attribute reads and writes each
            for message in messages:
                delivery = message.delivery
                if not delivery.settled and delivery.auto_ack:
                    delivery.settled = True
                    delivery.error = None
                    append(message)
        return won

    def expire(self, message: Delivered, error: BaseException) -> bool:
        """Fail the delivery (its ack deadline, or a stop handing it back); False if it
        was settled already."""
        return self.settle(message, error, source="deadline")

    def settle(self, message: Delivered, error: BaseException | None, *,
               source: str) -> bool:
        """Settle with ``error`` (None: success); the first settlement wins and is
        reported to the sink, a later one is ignored (with a warning when it comes from
        the handler: ``source`` "ack" or "handler") and returns False."""
        with _settle_lock:
            if self.settled:
                first = self.error
                late = True
            else:
                self.settled = True
                self.error = error
                late = False
                sink = self.sink
        if late:
            if source in ("ack", "handler"):
                log.warning(
                    "message %s: %s ignored, the delivery was already settled (%s)",
                    escape_control(message.id),
                    "ack" if source == "ack" else f"handler error {error!r}",
                    "failed: " + repr(first) if first is not None else "acked",
                    extra={"message_id": message.id, "topic": message.topic,
                           "attempt": message.attempt},
                )
            return False
        if sink is not None:
            sink(message, error)
        return True


def receipt_of(message: Delivered, kind: type[R], owner: str) -> R:
    """``message``'s receipt, checked to be ``kind`` (the adapter's receipt type).

    Raises :class:`~msgpatterns.errors.ConfigurationError` (a ``ValueError``) naming
    ``owner`` (e.g. "this InMemoryBroker") for a message another adapter delivered, or
    one never delivered (built by hand)."""
    receipt = message.delivery.receipt
    if not isinstance(receipt, kind):
        raise ConfigurationError(f"{message!r} was not delivered by {owner}")
    return receipt
