"""What both drivers hold: the checked options, the counts, the settler, the slots and
the retry scheduler, and the few steps they take alike (the ack deadline, moving
virtual time). The thread driver (:class:`msgpatterns.Consumer`) and the asyncio
driver (:class:`msgpatterns.aio.AsyncConsumer`) add only how they wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from msgpatterns.brokers.base import SupportsVirtualTime
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.errors import AckTimeout, ConfigurationError
from msgpatterns.message import Message, SettleCallback
from msgpatterns.retry import RetryPolicy
from msgpatterns.runtime.clock import Clock, RealClock, VirtualClock
from msgpatterns.runtime.flow import Slots
from msgpatterns.runtime.gate import KeyGate
from msgpatterns.runtime.idle import jump
from msgpatterns.runtime.options import check_common, duration, topic_list
from msgpatterns.runtime.scheduler import RetryScheduler
from msgpatterns.runtime.settler import Settler
from msgpatterns.runtime.stats import ConsumerStats
from msgpatterns.timer import Timer

__all__ = ["DriverBase"]


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
    _until_idle: bool
    _gate: KeyGate | None
    _scheduler: RetryScheduler[Message]
    _slots: Slots
    _settler: Settler
    _log: logging.Logger

    def _configure(self, where: str, *, broker: Any, handler: object, topics: Sequence[str],
                   group: str, retry: RetryPolicy | None, ordered: bool, max_in_flight: int,
                   ack_timeout: float | timedelta, decoder: Callable[[Any], Any] | None,
                   dead_letters: DeadLetterStore | None, poll_timeout: float | timedelta,
                   shutdown_timeout: float | timedelta | None, fetch_batch: int,
                   name: str | None, default_name: str, counts: Mapping[str, object],
                   rebind: SettleCallback, log: logging.Logger) -> None:
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
        self._log = log
        self._until_idle = False
        self._gate = None
        self._scheduler = RetryScheduler(VirtualClock(None, broker.now), self._retry_due)
        self._slots = Slots(self.stats, None, self._scheduler)
        self._settler = Settler(
            policy=self.retry, now=broker.now, group=group, name=self.name,
            handler_name=self.handler_name, own_store=dead_letters is not None,
            keep_redeliveries=self.ordered, rebind=rebind, log=log)

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        return len(self._slots)

    def _fresh_parts(self, timer: Timer) -> None:
        """At start: a key gate (ordered mode), the retry scheduler on its clock - the
        broker's virtual time while running until idle on a broker that has one, else
        real time on ``timer`` - and empty slots."""
        clock: Clock
        broker = self.broker
        if self._until_idle and isinstance(broker, SupportsVirtualTime):
            clock = VirtualClock(broker, self.broker.now)
        else:
            clock = RealClock(self.broker.now, timer)
        self._gate = KeyGate() if self.ordered else None
        self._scheduler = RetryScheduler(clock, self._retry_due)
        self._slots = Slots(self.stats, self._gate, self._scheduler)

    def _retry_due(self, message: Message) -> None:
        """A retry's timer fired: the driver runs it."""
        raise NotImplementedError

    def _count(self, counts: Mapping[str, int], message: Message | None = None) -> None:
        """``counts`` were just added to ``stats`` (the thread driver reports them)."""

    def _move_time(self, *, can_fetch: bool) -> tuple[bool, list[Message]] | None:
        """Nothing active: move virtual time to the next moment something can run
        (:func:`msgpatterns.runtime.idle.jump`). None when nothing could (or the
        broker refused: counted, logged); else whether a fetch may find something and
        the retries now due."""
        try:
            return jump(self.broker, self.topics, self.group, self._scheduler,
                        can_fetch=can_fetch)
        except Exception:  # a closed broker, a refused jump: wait instead of dying
            self.stats.broker_errors += 1
            self._count({"broker_errors": 1})
            self._log.exception("%s: moving virtual time failed", self.name)
            return None

    def _deadline(self, message: Message) -> None:
        """The ack deadline of ``message`` passed: fail the delivery (AckTimeout)."""
        error = AckTimeout(
            f"message {message.id} not acked within {self.ack_timeout:g}s "
            f"by handler {self.handler_name}"
        )
        if message.expire(error):
            self.stats.ack_timeouts += 1
            self._count({"ack_timeouts": 1}, message)
            self._log.warning("%s; failing the delivery", error,
                              extra=self._settler.extra(message))
