"""The one stats model: what the library counts, reported to one listener.

The consumer, the batching helpers and the idempotency checkers keep their in-process
counters (:class:`~msgpatterns.consumer.ConsumerStats`,
:class:`~msgpatterns.idempotency.IdempotencyStats`,
:class:`~msgpatterns.batching.BatchCounters`) exactly as before. At the very points
where they add to those counters they also report the same figures, under the same
names, to the process's :class:`Listener` - if one is installed. Exporters
(OpenTelemetry, and Prometheus through it) are listeners; so can be your own.

Guarantees:

* With no listener installed (the default) the only cost is one module-attribute
  read per event: nothing is built, timed or looked up.
* Every figure a listener receives is the same increment the in-process counter got,
  named after that counter's field (``acked``, ``duplicates``, ``processed``...), so
  exported totals equal the in-process ones.
* A listener that raises never breaks a delivery, a batch or a store call: the
  library logs the error and goes on.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from msgpatterns.message import Message

__all__ = [
    "CONSUMER_OUTCOMES",
    "DeliveryScope",
    "Health",
    "Listener",
    "ObservedConsumer",
    "Outcome",
    "get_listener",
    "outcome_of",
    "set_listener",
]

log = logging.getLogger("msgpatterns.observability")


class Outcome(enum.StrEnum):
    """How one delivery ended (the ``msgpatterns.outcome`` attribute)."""

    ACKED = "acked"
    RETRIED_LOCALLY = "retried_locally"
    RETRIED_LATER = "retried_later"
    DEAD_LETTERED = "dead_lettered"
    RELEASED = "released"
    #: The broker refused every way of settling it: it redelivers at its own timeout.
    UNSETTLED = "unsettled"


#: ConsumerStats field -> the delivery outcome it counts.
CONSUMER_OUTCOMES: Mapping[str, Outcome] = {
    "acked": Outcome.ACKED,
    "retried_locally": Outcome.RETRIED_LOCALLY,
    "redelivered": Outcome.RETRIED_LATER,
    "dead_lettered": Outcome.DEAD_LETTERED,
    "released": Outcome.RELEASED,
}


def outcome_of(counted: list[str] | tuple[str, ...]) -> Outcome:
    """The outcome of a settlement from the ConsumerStats fields it added to."""
    for name in reversed(counted):
        outcome = CONSUMER_OUTCOMES.get(name)
        if outcome is not None:
            return outcome
    return Outcome.UNSETTLED


class ObservedConsumer(Protocol):
    """What a listener may read of the consumer it hears about: a
    :class:`~msgpatterns.Consumer` or an :class:`~msgpatterns.aio.AsyncConsumer` (both
    report the same events, with the same figures)."""

    name: str
    group: str
    broker: Any

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        ...


class DeliveryScope:
    """What a listener keeps while one delivery runs (returned by
    :meth:`Listener.delivery_started`). The base does nothing."""

    __slots__ = ()

    def handler_returned(self, error: BaseException | None) -> None:
        """The handler (and decoder) returned or raised ``error``."""

    def close(self) -> None:
        """The runtime is done with the delivery on this thread (its settlement may
        still come later, from another thread)."""


class Listener:
    """Receives the library's figures and delivery events; every method is a no-op.

    Subclass it and override what you need, then :func:`set_listener`. Methods may be
    called from any thread, concurrently. ``consumer`` is a
    :class:`~msgpatterns.Consumer` or an :class:`~msgpatterns.aio.AsyncConsumer`; for
    the asyncio driver the methods are called on its event loop (a scope is opened
    and closed in the worker task that runs the handler, so a context a listener
    attaches there is the handler's own).
    """

    # -- consumer -------------------------------------------------------------------

    def consumer_counted(self, consumer: ObservedConsumer, counts: Mapping[str, int],
                         message: Message | None = None) -> None:
        """``consumer.stats`` fields just grew by ``counts`` (``fetched``, ``acked``,
        ``failed``, ``retried_locally``, ``redelivered``, ``dead_lettered``,
        ``ack_timeouts``, ``released``, ``broker_errors``); ``message`` when the
        figures are about one delivery."""

    def delivery_started(self, consumer: ObservedConsumer,
                         message: Message) -> DeliveryScope | None:
        """The handler is about to run ``message`` on this thread."""
        return None

    def delivery_settled(self, consumer: ObservedConsumer, message: Message, counted: list[str],
                         error: BaseException | None) -> None:
        """``message`` was settled with ``error`` (None: success) and counted as
        ``counted`` (ConsumerStats fields). The default reports the counts."""
        self.consumer_counted(consumer, dict.fromkeys(counted, 1), message)

    def inject(self, headers: dict[str, str], message: Message | None = None) -> None:
        """Add trace context to outgoing ``headers`` (never replacing a header that is
        there): ``message``'s delivery, or the current context."""

    # -- idempotency ------------------------------------------------------------------

    def idempotency_counted(self, checker: str, counts: Mapping[str, int]) -> None:
        """A checker's ``stats`` (IdempotencyStats fields) grew by ``counts``;
        ``checker`` names it (its class, or "" when unknown)."""

    def store_round_trip(self, checker: str, operation: str, seconds: float,
                         error: BaseException | None) -> None:
        """One store operation (``claim``, ``claim_many``, ``complete``, ...), retries
        included, took ``seconds`` and failed with ``error`` (None: it succeeded)."""

    # -- batching -------------------------------------------------------------------

    def batch_counted(self, queue: str, counts: Mapping[str, int]) -> None:
        """A batching helper's counters (BatchCounters fields ``items``, ``rejected``)
        grew by ``counts``; ``queue`` is its name."""

    def batch_processed(self, queue: str, size: int, seconds: float, failed: bool) -> None:
        """One processor call on ``size`` items took ``seconds`` (the flush latency);
        ``failed`` when it raised. Counts as BatchCounters ``batches``, ``processed``
        and (when failed) ``errors``."""


#: The process's listener; None (the default) turns every report off.
listener: Listener | None = None


def set_listener(new: Listener | None) -> Listener | None:
    """Install ``new`` as the process's listener (None: none); returns the previous."""
    global listener
    if new is not None and not isinstance(new, Listener):
        from msgpatterns.errors import ConfigurationError

        raise ConfigurationError(
            f"set_listener needs a msgpatterns.observability.Listener or None, "
            f"got {type(new).__name__}"
        )
    previous, listener = listener, new
    if new is not previous:
        for key, callback in list(_watchers.items()):
            method = callback()
            if method is None:  # its runtime is gone
                _watchers.pop(key, None)
            else:
                report(method)
    return previous


#: What :func:`watch_listener` registered: called after the listener changed.
_watchers: dict[int, weakref.WeakMethod[Callable[[], None]]] = {}
_watch_keys = itertools.count()


def watch_listener(callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` (a bound method, held weakly) after every change of the
    listener: a runtime that chose its hot path for "no listener" when it started
    chooses again. Returns the function that stops watching."""
    key = next(_watch_keys)
    _watchers[key] = weakref.WeakMethod(callback)

    def unwatch() -> None:
        _watchers.pop(key, None)

    return unwatch


def get_listener() -> Listener | None:
    """The installed listener, or None."""
    return listener


def report(fn: Any, *args: Any) -> None:
    """Call a listener method; an exception is logged, never raised."""
    try:
        fn(*args)
    except Exception:
        log.exception("msgpatterns telemetry listener failed in %s",
                      getattr(fn, "__name__", fn))


@dataclass(frozen=True, slots=True)
class Health:
    """A snapshot of one consumer's health.

    Attributes:
        name: the consumer's name.
        running: started, not stopping, and every thread it started is alive.
        state: ``new``, ``running``, ``stopping`` or ``stopped``.
        last_fetch_at: when the last fetch returned (``time.time()``), None before any.
        last_fetch_ok: whether that fetch succeeded (None before any).
        in_flight: messages fetched and not yet settled.
        oldest_unsettled_age: seconds since the oldest of them was fetched (a retry
            copy counts from its original's fetch); None when nothing is in flight.
        broker_connected: the broker's own ``connected`` property when it has one,
            else whether the last fetch succeeded; None before any fetch.
    """

    name: str
    running: bool
    state: str
    last_fetch_at: float | None
    last_fetch_ok: bool | None
    in_flight: int
    oldest_unsettled_age: float | None
    broker_connected: bool | None

    @property
    def live(self) -> bool:
        """For a liveness probe: the consumer is running."""
        return self.running

    @property
    def ready(self) -> bool:
        """For a readiness probe: running, the last fetch succeeded and the broker is
        not known to be disconnected."""
        return self.running and self.last_fetch_ok is True and self.broker_connected is not False

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["live"], data["ready"] = self.live, self.ready
        if self.last_fetch_at is not None:
            data["seconds_since_fetch"] = max(0.0, time.time() - self.last_fetch_at)
        return data
