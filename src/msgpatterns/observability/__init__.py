"""Observability: one stats model, OpenTelemetry traces and metrics, Prometheus, health.

* :func:`instrument` (``otel`` extra) sends spans and metrics of every consumer,
  checker and batching helper in the process to OpenTelemetry; :func:`uninstrument`
  stops it.
* :func:`serve_prometheus` serves those metrics at ``/metrics`` without a collector.
* ``Consumer.health()`` and :class:`HealthServer` (``/livez``, ``/readyz``).
* :class:`Listener` and :func:`set_listener`: the interface behind all of it, for an
  exporter of your own.

Nothing is recorded, timed or imported from OpenTelemetry until a listener is
installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.observability.stats import (
    DeliveryScope,
    Listener,
    Outcome,
    get_listener,
    set_listener,
)

if TYPE_CHECKING:
    from msgpatterns.observability.health import Health, HealthServer
    from msgpatterns.observability.otel import OpenTelemetry, instrument, uninstrument
    from msgpatterns.observability.prometheus import PrometheusEndpoint, serve_prometheus

__all__ = [
    "DeliveryScope",
    "Health",
    "HealthServer",
    "Listener",
    "OpenTelemetry",
    "Outcome",
    "PrometheusEndpoint",
    "get_listener",
    "instrument",
    "serve_prometheus",
    "set_listener",
    "trace_headers",
    "uninstrument",
]


def trace_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """``headers`` (a new dict when None) plus the current trace context, for a
    publisher that does not go through a broker adapter (the in-memory broker, a
    foreign client). A header already there is kept; nothing is added while no
    listener is installed."""
    out = {} if headers is None else headers
    listener = get_listener()
    if listener is not None:
        listener.inject(out)
    return out


__getattr__ = lazy_attributes(__name__, {
    "Health": "msgpatterns.observability.health",
    "HealthServer": "msgpatterns.observability.health",
    "OpenTelemetry": "msgpatterns.observability.otel",
    "instrument": "msgpatterns.observability.otel",
    "uninstrument": "msgpatterns.observability.otel",
    "PrometheusEndpoint": "msgpatterns.observability.prometheus",
    "serve_prometheus": "msgpatterns.observability.prometheus",
})
