"""OpenTelemetry traces and metrics for consumers, checkers and batching helpers.

Enable it once per process (needs the ``otel`` extra, ``opentelemetry-api``)::

    from msgpatterns.observability import instrument

    instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

Without providers the globally configured ones are used (OpenTelemetry's API is a
no-op until an SDK is configured). :func:`uninstrument` turns it off again.

Traces follow the OpenTelemetry messaging semantic conventions: one span per delivery
attempt, kind ``CONSUMER``, named ``process <topic>``, with ``messaging.system``,
``messaging.destination.name``, ``messaging.consumer.group.name``,
``messaging.message.id``, ``messaging.operation.type=process``,
``messaging.operation.name=process``, ``messaging.msgpatterns.attempt`` and, once
settled, ``messaging.msgpatterns.outcome`` (``acked``, ``retried_locally``,
``retried_later``, ``dead_lettered``, ``released``); a failed attempt has error status,
``error.type`` and the exception as an event. The span continues the trace whose W3C
``traceparent`` the message carries, and is the current span while the handler runs.
Outgoing messages (publish, redelivery, dead letter) carry trace context through the
adapters' wire headers (:mod:`msgpatterns.brokers.codec`); a header already present
(the original publisher's) is never replaced.

Metrics (one name per in-process counter; see :mod:`msgpatterns.observability.stats`):

* ``msgpatterns.consumer.deliveries`` {``msgpatterns.outcome``}: settled deliveries
  by outcome (ConsumerStats ``acked``, ``retried_locally``, ``redelivered`` as
  ``retried_later``, ``dead_lettered``, ``released``);
  ``msgpatterns.consumer.fetched``, ``.failed``, ``.ack_timeouts``, ``.broker_errors``;
* ``messaging.process.duration`` (s): handler duration, with ``error.type`` on failure,
  for a uniform random sample of the deliveries (``duration_sample_rate``, 0.1 by
  default; 1.0 records every one: an SDK ``Histogram.record`` costs about 8 us, more
  than everything else here together);
* ``msgpatterns.consumer.in_flight``: observable gauge, messages held per consumer;
* ``msgpatterns.idempotency.<field>`` for every IdempotencyStats field
  (``duplicates``: duplicates skipped, ``in_progress``: in-progress conflicts, ...),
  ``msgpatterns.idempotency.store.round_trips`` {``msgpatterns.operation``,
  ``msgpatterns.result``} and ``msgpatterns.idempotency.store.duration`` (s, sampled
  like the handler duration);
* ``msgpatterns.batch.items``, ``.rejected``, ``.batches``, ``.processed``,
  ``.errors``, ``msgpatterns.batch.size`` (histogram) and
  ``msgpatterns.batch.flush.duration`` (s), per ``msgpatterns.queue``.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections import Counter as _Tally
from collections.abc import Iterable, Mapping
from random import random as _random
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from msgpatterns._extras import require

require("opentelemetry.trace", "otel")

from opentelemetry import context as otel_context  # noqa: E402
from opentelemetry import metrics as otel_metrics  # noqa: E402
from opentelemetry import propagate, trace  # noqa: E402
from opentelemetry.metrics import CallbackOptions, Observation  # noqa: E402
from opentelemetry.trace import SpanKind, Status, StatusCode  # noqa: E402

from msgpatterns.errors import ConfigurationError, describe  # noqa: E402
from msgpatterns.observability import stats as _stats  # noqa: E402
from msgpatterns.observability.stats import (  # noqa: E402
    CONSUMER_OUTCOMES,
    DeliveryScope,
    Listener,
    ObservedConsumer,
    Outcome,
    outcome_of,
)

if TYPE_CHECKING:
    from msgpatterns.message import Message

__all__ = [
    "DEFAULT_DURATION_SAMPLE_RATE",
    "OpenTelemetry",
    "instrument",
    "messaging_system",
    "uninstrument",
]

#: The share of deliveries (and idempotency store round trips) whose duration is
#: recorded in the duration histograms unless told otherwise: counters are exact
#: whatever it is; one OpenTelemetry SDK ``Histogram.record`` costs about 8 us.
DEFAULT_DURATION_SAMPLE_RATE = 0.1

_SCOPE = "msgpatterns"
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            5.0, 10.0, 30.0, 60.0)
_SIZES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

#: Broker class -> ``messaging.system`` (a broker may declare ``messaging_system``);
#: the sync and the asyncio adapter of one broker name the same system.
_SYSTEMS = {
    "KafkaBroker": "kafka",
    "AIOKafkaBroker": "kafka",
    "RabbitMQBroker": "rabbitmq",
    "AsyncRabbitMQBroker": "rabbitmq",
    "RedisStreamsBroker": "redis",
    "AsyncRedisStreamsBroker": "redis",
    "NatsJetStreamBroker": "nats",
    "InMemoryBroker": "memory",
    "AsyncInMemoryBroker": "memory",
}


def messaging_system(broker: object) -> str:
    """The ``messaging.system`` value for ``broker``: what it declares
    (``messaging_system``), its adapter's system, or - for an asyncio face of a sync
    broker (``ThreadedAsyncBroker``...) - its sync broker's."""
    declared = getattr(broker, "messaging_system", None)
    if isinstance(declared, str) and declared:
        return declared
    name = type(broker).__name__
    system = _SYSTEMS.get(name)
    if system is not None:
        return system
    inner = getattr(broker, "sync", None)
    if inner is not None and inner is not broker and not callable(inner):
        return messaging_system(inner)
    return name.lower()


Key = tuple[tuple[str, Any], ...]


class _Totals:
    """Counters summed here, cheaply, and handed to OpenTelemetry as observable
    counters when a reader collects: an SDK ``Counter.add`` cleans and hashes its
    attributes on every call, tens of microseconds a message under load."""

    def __init__(self, meter: otel_metrics.Meter) -> None:
        self._meter = meter
        self._lock = threading.Lock()
        self._create = threading.Lock()
        self._series: dict[str, dict[Key, int]] = {}

    def add(self, name: str, unit: str, count: int, key: Key) -> None:
        series = self._series.get(name)
        if series is None:
            series = self._new(name, unit)
        with self._lock:
            series[key] = series.get(key, 0) + count

    def _new(self, name: str, unit: str) -> dict[Key, int]:
        with self._create:  # never under _lock: a collection holds the SDK's lock, then ours
            series = self._series.get(name)
            if series is None:
                series = {}
                self._meter.create_observable_counter(
                    name, [functools.partial(self._observe, name)], unit)
                self._series[name] = series
        return series

    def _observe(self, name: str, options: CallbackOptions) -> list[Observation]:
        with self._lock:
            items = list(self._series[name].items())
        return [Observation(value, dict(key)) for key, value in items]


def _error_type(error: BaseException) -> str:
    kind = type(error)
    return kind.__qualname__ if kind.__module__ == "builtins" \
        else f"{kind.__module__}.{kind.__qualname__}"


class _Timed(DeliveryScope):
    """A delivery whose handler duration is recorded (metrics only, no span)."""

    __slots__ = ("_histogram", "_started", "attributes")

    def __init__(self, histogram: otel_metrics.Histogram, attributes: dict[str, Any]) -> None:
        self._histogram = histogram
        self.attributes = attributes
        self._started = time.perf_counter()

    def handler_returned(self, error: BaseException | None) -> None:
        took = time.perf_counter() - self._started
        attributes = self.attributes
        if error is not None:
            attributes = {**attributes, "error.type": _error_type(error)}
        self._histogram.record(took, attributes)


class _Scope(DeliveryScope):
    """A traced delivery: its span is the current one until :meth:`close`; its handler
    duration is recorded when ``histogram`` is given (sampled in)."""

    __slots__ = ("_histogram", "_span", "_started", "_token", "attributes")

    def __init__(self, histogram: otel_metrics.Histogram | None, span: trace.Span,
                 token: object, attributes: dict[str, Any]) -> None:
        self._histogram = histogram
        self._span = span
        self._token = token
        self.attributes = attributes
        self._started = time.perf_counter() if histogram is not None else 0.0

    def handler_returned(self, error: BaseException | None) -> None:
        histogram = self._histogram
        if histogram is None:
            return
        took = time.perf_counter() - self._started
        attributes = self.attributes
        if error is not None:
            attributes = {**attributes, "error.type": _error_type(error)}
        histogram.record(took, attributes)

    def close(self) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None


class OpenTelemetry(Listener):
    """The OpenTelemetry listener (see the module docstring for what it records).

    ``tracer_provider``/``meter_provider``: where spans and metrics go (None: the
    global ones). ``tracing=False`` or ``metrics=False`` turns that half off.

    ``duration_sample_rate``: the share of deliveries, chosen at random, whose handler
    duration is recorded in ``messaging.process.duration`` (and of idempotency store
    round trips in ``msgpatterns.idempotency.store.duration``), from 0.0 (none) to 1.0
    (every one). Counters (deliveries by outcome, fetched, failed, store round trips...)
    are exact whatever it is. A sample keeps the distribution (quantiles, mean), not
    the count: a histogram's count and sum are about rate times the deliveries', so
    count deliveries with ``msgpatterns.consumer.deliveries``. Why sampled by default:
    one SDK ``Histogram.record`` costs about 8 us of CPU, where a no-op delivery
    through the consumer costs about 6 us in all; at 0.1 it adds under 1 us a delivery.
    """

    def __init__(self, *, tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: otel_metrics.MeterProvider | None = None,
                 tracing: bool = True, metrics: bool = True,
                 duration_sample_rate: float = DEFAULT_DURATION_SAMPLE_RATE) -> None:
        from msgpatterns import __version__

        rate = float(duration_sample_rate)
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise ConfigurationError(
                f"duration_sample_rate must be between 0.0 and 1.0, got {duration_sample_rate!r}")
        #: The share of durations recorded (0.0 when metrics are off: nothing to time).
        self.duration_sample_rate = rate if metrics else 0.0

        self.tracer: trace.Tracer | None = (
            trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider)
            if tracing else None
        )
        provider = meter_provider if metrics else otel_metrics.NoOpMeterProvider()
        meter = otel_metrics.get_meter(_SCOPE, __version__, meter_provider=provider)
        self._meter = meter
        self._lock = threading.Lock()
        self._spans: dict[Message, trace.Span] = {}
        self._consumers: weakref.WeakKeyDictionary[ObservedConsumer, Key] = (
            weakref.WeakKeyDictionary()
        )
        self._totals = _Totals(meter)
        #: id(consumer) -> (a weak reference to it, its attributes): one dict lookup
        #: per delivery instead of a WeakKeyDictionary's (which makes a weakref each).
        self._by_id: dict[int, tuple[weakref.ref[ObservedConsumer], Key]] = {}
        #: (consumer attributes, topic) -> the duration attributes; (consumer
        #: attributes, topic, counter) -> (metric, unit, series key). Made once each
        #: (topics are few; bounded all the same), never mutated.
        self._destinations: dict[tuple[Key, str], dict[str, Any]] = {}
        self._series: dict[tuple[Key, str, str], tuple[str, str, Key]] = {}
        self._process_duration = meter.create_histogram(
            "messaging.process.duration", "s", "Handler duration per delivery",
            explicit_bucket_boundaries_advisory=_SECONDS)
        self._store_duration = meter.create_histogram(
            "msgpatterns.idempotency.store.duration", "s",
            "Idempotency store operation duration", explicit_bucket_boundaries_advisory=_SECONDS)
        self._batch_size = meter.create_histogram(
            "msgpatterns.batch.size", "{item}", "Items per processor call",
            explicit_bucket_boundaries_advisory=_SIZES)
        self._flush_duration = meter.create_histogram(
            "msgpatterns.batch.flush.duration", "s", "Processor call duration per batch",
            explicit_bucket_boundaries_advisory=_SECONDS)
        meter.create_observable_gauge(
            "msgpatterns.consumer.in_flight", [self._observe_in_flight], "{message}",
            "Messages fetched and not yet settled")

    # -- helpers ----------------------------------------------------------------------

    def _consumer_key(self, consumer: ObservedConsumer) -> Key:
        entry = self._by_id.get(id(consumer))
        if entry is not None and entry[0]() is consumer:
            return entry[1]
        key = (("messaging.system", messaging_system(consumer.broker)),
               ("messaging.consumer.group.name", consumer.group))
        ident = id(consumer)
        by_id = self._by_id
        with self._lock:
            self._consumers[consumer] = key
            by_id[ident] = (weakref.ref(consumer, lambda _: by_id.pop(ident, None)), key)
        return key

    def _destination_attributes(self, consumer: ObservedConsumer, topic: str) -> dict[str, Any]:
        base = self._consumer_key(consumer)
        attributes = self._destinations.get((base, topic))
        if attributes is None:
            attributes = dict(base)
            attributes["messaging.destination.name"] = topic
            if len(self._destinations) < 10_000:
                self._destinations[base, topic] = attributes
        return attributes

    def _series_of(self, base: Key, topic: str | None, name: str) -> tuple[str, str, Key]:
        """The metric, unit and series key that counter ``name`` of a consumer adds to."""
        cache_key = (base, topic or "", name)
        found = self._series.get(cache_key)
        if found is not None and topic is not None:
            return found
        key = base if topic is None else (*base, ("messaging.destination.name", topic))
        outcome = CONSUMER_OUTCOMES.get(name)
        if outcome is not None:
            found = ("msgpatterns.consumer.deliveries", "{delivery}",
                     (*key, ("msgpatterns.outcome", outcome.value)))
        else:
            found = (f"msgpatterns.consumer.{name}", "{message}", key)
        if topic is not None and len(self._series) < 10_000:
            self._series[cache_key] = found
        return found

    def _observe_in_flight(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            consumers = list(self._consumers.items())
        return [Observation(consumer.in_flight, {**dict(key), "msgpatterns.consumer":
                                                 consumer.name})
                for consumer, key in consumers]

    # -- consumer -----------------------------------------------------------------------

    def consumer_counted(self, consumer: ObservedConsumer, counts: Mapping[str, int],
                         message: Message | None = None) -> None:
        base = self._consumer_key(consumer)
        topic = None if message is None else message.topic
        add = self._totals.add
        for name, count in counts.items():
            if count:
                metric, unit, key = self._series_of(base, topic, name)
                add(metric, unit, count, key)

    def _timed(self) -> bool:
        """Whether this duration is sampled in (see ``duration_sample_rate``)."""
        rate = self.duration_sample_rate
        return rate >= 1.0 or (rate > 0.0 and _random() < rate)

    def delivery_started(self, consumer: ObservedConsumer,
                         message: Message) -> DeliveryScope | None:
        timed = self._timed()
        tracer = self.tracer
        if tracer is None:  # metrics only: a scope only for a sampled duration
            if not timed:
                return None
            return _Timed(self._process_duration,
                          self._destination_attributes(consumer, message.topic))
        attributes = self._destination_attributes(consumer, message.topic)
        parent = propagate.extract(message.headers) if message.headers else None
        span_attributes: dict[str, Any] = {
            **attributes,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.msgpatterns.attempt": message.attempt,
            "messaging.msgpatterns.local_retries": message.local_retries,
        }
        if message.id is not None:
            span_attributes["messaging.message.id"] = message.id
        if message.key is not None:
            span_attributes["messaging.msgpatterns.key"] = message.key
        span = tracer.start_span(f"process {message.topic}", context=parent,
                                 kind=SpanKind.CONSUMER, attributes=span_attributes)
        self._spans[message] = span  # one dict operation: atomic
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return _Scope(self._process_duration if timed else None, span, token, attributes)

    def delivery_settled(self, consumer: ObservedConsumer, message: Message, counted: list[str],
                         error: BaseException | None) -> None:
        if len(counted) == 1:  # the common case: one counter, one series
            metric, unit, key = self._series_of(self._consumer_key(consumer),
                                                message.topic, counted[0])
            self._totals.add(metric, unit, 1, key)
        else:
            self.consumer_counted(consumer, _Tally(counted), message)
        if self.tracer is None:
            return
        span = self._spans.pop(message, None)  # one dict operation: atomic
        if span is None:
            return
        if not span.is_recording():  # sampled out: nothing to add to it
            span.end()
            return
        outcome = outcome_of(counted)
        span.set_attribute("messaging.msgpatterns.outcome", outcome.value)
        if error is not None and outcome not in (Outcome.ACKED, Outcome.RELEASED):
            span.set_attribute("error.type", _error_type(error))
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, describe(error)[:200]))
        span.end()

    def inject(self, headers: dict[str, str], message: Message | None = None) -> None:
        span = None
        if message is not None:
            span = self._spans.get(message)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=None if span is None
                         else trace.set_span_in_context(span))
        for name, value in carrier.items():
            headers.setdefault(name, value)

    # -- idempotency ----------------------------------------------------------------------

    def idempotency_counted(self, checker: str, counts: Mapping[str, int]) -> None:
        key: Key = (("msgpatterns.checker", checker),) if checker else ()
        for name, count in counts.items():
            if count:
                self._totals.add(f"msgpatterns.idempotency.{name}", "{key}", count, key)

    def store_round_trip(self, checker: str, operation: str, seconds: float,
                         error: BaseException | None) -> None:
        if self._timed():
            self._store_duration.record(seconds, {"msgpatterns.checker": checker,
                                                  "msgpatterns.operation": operation})
        self._totals.add("msgpatterns.idempotency.store.round_trips", "{operation}", 1,
                         (("msgpatterns.checker", checker), ("msgpatterns.operation", operation),
                          ("msgpatterns.result", "ok" if error is None else "error")))

    # -- batching -------------------------------------------------------------------------

    def batch_counted(self, queue: str, counts: Mapping[str, int]) -> None:
        key: Key = (("msgpatterns.queue", queue),)
        for name, count in counts.items():
            if count:
                self._totals.add(f"msgpatterns.batch.{name}", "{item}", count, key)

    def batch_processed(self, queue: str, size: int, seconds: float, failed: bool) -> None:
        attributes = {"msgpatterns.queue": queue}
        self._batch_size.record(size, attributes)
        self._flush_duration.record(seconds, attributes)
        self.batch_counted(queue, {"batches": 1, "processed": size, "errors": int(failed)})

    # -- installation -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if _stats.listener is self:
            _stats.set_listener(None)


def instrument(*, tracer_provider: trace.TracerProvider | None = None,
               meter_provider: otel_metrics.MeterProvider | None = None,
               tracing: bool = True, metrics: bool = True,
               duration_sample_rate: float = DEFAULT_DURATION_SAMPLE_RATE) -> OpenTelemetry:
    """Send every consumer's, checker's and batching helper's spans and metrics in
    this process to OpenTelemetry (replacing any listener installed before); returns
    the listener, which is also a context manager that uninstalls it.
    ``duration_sample_rate``: the share of durations recorded in the duration
    histograms (see :class:`OpenTelemetry`; counters are always exact)."""
    listener = OpenTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider,
                             tracing=tracing, metrics=metrics,
                             duration_sample_rate=duration_sample_rate)
    _stats.set_listener(listener)
    return listener


def uninstrument() -> None:
    """Stop sending telemetry (remove the process's listener)."""
    _stats.set_listener(None)
