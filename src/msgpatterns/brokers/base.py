"""The :class:`Broker` protocol every adapter implements.

The consumer runtime needs five verbs from a broker. Each adapter maps them onto what
its broker offers (native delays, redelivery counts, dead-letter queues):

* ``fetch`` - up to ``max_messages`` deliveries for a consumer group, waiting at most
  ``timeout`` seconds. Each returned :class:`~msgpatterns.Message` has a durable
  ``attempt`` and a ``receipt`` the adapter understands.
* ``ack`` - the delivery succeeded; it is never delivered to this group again
  (except as an at-least-once duplicate).
* ``nack(delay)`` - redeliver after ``delay`` seconds with ``attempt + 1``. The
  message's headers at the time of the call travel with the redelivery.
* ``dead_letter`` - park the message with its :class:`~msgpatterns.DeadLetter`
  record and remove it from the group's queue.
* ``publish`` - send a new message; returns its id.
* ``close`` - release everything the adapter opened (connections, threads, producers)
  after sending what it queued (acks); afterwards every operation raises
  :class:`~msgpatterns.errors.BrokerClosed` and the adapter never reconnects.
  Adapters are context managers: ``with RedisStreamsBroker(...) as broker: ...``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from msgpatterns.deadletter import DeadLetter
from msgpatterns.headers import WireBounds
from msgpatterns.message import Message

__all__ = ["Broker", "SupportsAckMany", "SupportsVirtualTime", "SupportsWireBounds"]


@runtime_checkable
class Broker(Protocol):
    """What the consumer runtime needs from a broker client."""

    def fetch(
        self,
        topics: Sequence[str],
        group: str,
        max_messages: int = 1,
        timeout: float = 0.0,
    ) -> list[Message]: ...

    def ack(self, message: Message) -> None: ...

    def nack(self, message: Message, delay: float = 0.0) -> None: ...

    def dead_letter(self, message: Message, record: DeadLetter) -> None: ...

    def publish(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str: ...

    def now(self) -> float:
        """The broker's clock in seconds since the epoch (virtual on the fake)."""
        ...

    def close(self) -> None:
        """Flush queued acks, release connections and threads; idempotent."""
        ...


@runtime_checkable
class SupportsAckMany(Protocol):
    """A broker that acks many deliveries in one call (an optional speed-up the
    runtime uses when it settles a batch; each delivery as :meth:`Broker.ack` would)."""

    def ack_many(self, messages: Sequence[Message]) -> None: ...


@runtime_checkable
class SupportsVirtualTime(Protocol):
    """A broker whose clock a test may move forward (the in-memory fake).

    ``Consumer.run_until_idle`` uses it to jump to the next due delivery instead of
    sleeping, and only while nothing is in flight.
    """

    def next_due(self, topics: Sequence[str], group: str) -> float | None:
        """When the next delayed or timed-out delivery for the group becomes due."""
        ...

    def advance_to(self, when: float) -> None:
        """Move the clock forward to ``when`` (never backwards)."""
        ...


@runtime_checkable
class SupportsWireBounds(Protocol):
    """A broker that bounds the library's headers on incoming messages by each
    consumer's own policy (every adapter of the library; sync and async alike).

    A consumer calls :meth:`bound_wire` once, when it is built, with
    :meth:`msgpatterns.RetryPolicy.wire_bounds`: attempt headers beyond the bound are
    ignored and due times beyond it are due now, for that group's deliveries."""

    def bound_wire(self, group: str, bounds: WireBounds) -> None: ...
