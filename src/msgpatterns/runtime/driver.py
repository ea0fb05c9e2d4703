"""What both drivers hold: the checked options, the counts and the settler, and the few
steps they take alike (choosing the retry clock, the ack deadline, reporting counts and
opening a delivery's telemetry scope). The thread driver (:class:`msgpatterns.Consumer`)
and the asyncio driver (:class:`msgpatterns.aio.AsyncConsumer`) add only how they wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.brokers.base import SupportsVirtualTime, SupportsWireBounds
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.errors import AckTimeout, ClosedError, ConfigurationError
from msgpatterns.message import Message, SettleCallback
from msgpatterns.observability.stats import DeliveryScope, Health, Listener
from msgpatterns.retry import RetryPolicy
from msgpatterns.runtime.clock import Clock, RealClock, VirtualClock
from msgpatterns.runtime.options import check_common, duration, topic_list
from msgpatterns.runtime.settler import Settler
from msgpatterns.runtime.stats import ConsumerStats, Reporter
from msgpatterns.timer import Timer

__all__ = ["DriverBase", "ack_deadline_passed"]


class DriverBase:
    """Shared state and steps of a consumer driver (not used on its own)."""

    broker: Any
    topics: list[str]
    group: str
    retry: RetryPolicy
    ordered: bool
    max_in_flight: int
    ack_timeout: float
    decoder: Callable[[Any], Any] | None
    dead_letters: DeadLetterStore | None
    poll_timeout: float
    shutdown_timeout: float | None
    fetch_batch: int
    name: str
    handler_name: str
    stats: ConsumerStats
    batch: bool
    _settler: Settler
    _reporter: Reporter
    _log: logging.Logger
    #: Set by close() / aclose(): the driver never starts again.
    _closed = False

    @property
    def closed(self) -> bool:
        """True once ``close()`` (``aclose()``) was called: the consumer never starts
        again."""
        return self._closed

    def _check_open(self) -> None:
        """Raise :class:`~msgpatterns.errors.ClosedError` once closed."""
        if self._closed:
            raise ClosedError(f"{self.name} is closed: build a new consumer "
                              "(a closed consumer never starts again)")

    def _configure(self, where: str, *, broker: Any, handler: object, topics: Sequence[str],
                   group: str, retry: RetryPolicy | None, ordered: bool, max_in_flight: int,
                   ack_timeout: float | timedelta, decoder: Callable[[Any], Any] | None,
                   dead_letters: DeadLetterStore | None, poll_timeout: float | timedelta,
                   shutdown_timeout: float | timedelta | None, fetch_batch: int,
                   name: str | None, default_name: str, counts: Mapping[str, object],
                   log: logging.Logger, rebind: SettleCallback | None = None) -> None:
        """Check and keep the options both drivers take (ConfigurationError naming the
        first wrong one), and make the settler and the (not yet started) slots."""
        check_common(where, retry=retry, dead_letters=dead_letters, group=group, name=name,
                     counts={"max_in_flight": max_in_flight, "fetch_batch": fetch_batch,
                             **counts})
        self.broker = broker
        self.topics = topic_list(topics)
        self.group = group
        self.retry = retry if retry is not None else RetryPolicy()
        self.ordered = bool(ordered)
        self.max_in_flight = max_in_flight
        self.ack_timeout = duration(ack_timeout, "ack_timeout") or 0.0
        self.decoder = decoder
        self.dead_letters = dead_letters
        poll = duration(poll_timeout, "poll_timeout")
        if not poll:
            raise ConfigurationError(
                f"{where} poll_timeout must be positive, got {poll_timeout!r}")
        self.poll_timeout = poll
        self.shutdown_timeout = duration(shutdown_timeout, "shutdown_timeout")
        self.fetch_batch = fetch_batch
        self.name = name or default_name
        self.handler_name = getattr(handler, "__qualname__", None) or repr(handler)
        self.stats = ConsumerStats()
        self._reporter = Reporter(self)
        self._log = log
        if isinstance(broker, SupportsWireBounds):  # the library's headers: as far as
            broker.bound_wire(group, self.retry.wire_bounds())  # this policy writes them
        self._settler = Settler(
            policy=self.retry, now=broker.now, group=group, name=self.name,
            handler_name=self.handler_name, own_store=dead_letters is not None,
            keep_redeliveries=self.ordered, rebind=rebind, log=log)

    def _retry_clock(self, timer: Timer, until_idle: bool) -> Clock:
        """The clock retries wait on: the broker's virtual time while running until
        idle on a broker that has one, else real time on ``timer``."""
        broker = self.broker
        if until_idle and isinstance(broker, SupportsVirtualTime):
            return VirtualClock(broker, self.broker.now)
        return RealClock(self.broker.now, timer)

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        raise NotImplementedError

    def health(self) -> Health:
        """A snapshot of this consumer's health (see the drivers)."""
        raise NotImplementedError

    def _count(self, counts: Mapping[str, int], message: Message | None = None) -> None:
        """``counts`` were just added to ``stats``: report them to the telemetry
        listener (no cost without one)."""
        self._reporter.count(counts, message)

    def _start_scope(self, listener: Listener, message: Message) -> DeliveryScope | None:
        """``message``'s handler is about to run: the listener's scope for it (None when
        the listener failed: logged, never raised)."""
        try:
            return listener.delivery_started(self, message)
        except Exception:
            self._log.exception("%s: telemetry listener failed", self.name,
                                extra=self._settler.extra(message))
            return None

    def _deadline(self, message: Message) -> None:
        """The ack deadline of ``message`` passed: fail the delivery (AckTimeout)."""
        ack_deadline_passed(message, self.ack_timeout, self.handler_name, self.stats,
                            self._count, self._log, self._settler)


def ack_deadline_passed(message: Message, ack_timeout: float, handler_name: str,
                        stats: ConsumerStats,
                        count: Callable[[Mapping[str, int], Message], object],
                        log: logging.Logger, settler: Settler) -> None:
    """The ack deadline of ``message`` passed: fail the delivery with
    :class:`~msgpatterns.errors.AckTimeout` (counted, logged) unless it was settled
    already. Both drivers' deadline trackers end here (the asyncio driver binds it
    with :func:`functools.partial`, so the timer never calls into the consumer)."""
    error = AckTimeout(
        f"message {message.id} not acked within {ack_timeout:g}s by handler {handler_name}"
    )
    if message.delivery.expire(message, error):
        stats.ack_timeouts += 1
        count({"ack_timeouts": 1}, message)
        log.warning("%s; failing the delivery", escape_control(error),
                    extra=settler.extra(message))
