"""Prometheus without a collector: the OpenTelemetry metrics at ``/metrics``.

::

    from msgpatterns.observability import serve_prometheus

    endpoint = serve_prometheus(port=9464)   # also instruments the process
    ...
    endpoint.close()

It is the documented setup spelled out: an OpenTelemetry SDK ``MeterProvider`` whose
reader is the OpenTelemetry Prometheus exporter (``PrometheusMetricReader``) on its own
``prometheus_client`` registry, served by ``prometheus_client``'s ``MetricsHandler`` (the
handler of its ``start_http_server``) on the bounded server of
:mod:`msgpatterns.observability.endpoint` (a read timeout, at most ``max_connections``
at once, no traceback for a client that hangs up), and
:func:`~msgpatterns.observability.instrument` with that provider. Needs
``opentelemetry-sdk``, ``opentelemetry-exporter-prometheus`` and ``prometheus-client``.
Names follow the exporter's translation: ``msgpatterns.consumer.deliveries`` becomes
``msgpatterns_consumer_deliveries_total{msgpatterns_outcome="acked",...}``.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.observability import stats as _stats
from msgpatterns.observability.endpoint import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    BoundedHTTPServer,
    check_bounds,
)

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from msgpatterns.observability.otel import OpenTelemetry

__all__ = ["PrometheusEndpoint", "serve_prometheus"]


class PrometheusEndpoint:
    """A running ``/metrics`` endpoint; :meth:`close` stops it and uninstalls its
    listener (if it is still the installed one)."""

    def __init__(self, server: Any, thread: Any, provider: Any,
                 listener: OpenTelemetry) -> None:
        self._server = server
        self._thread = thread
        self.meter_provider = provider
        self.listener = listener
        self._closed = False

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The metrics URL, ``http://host:port/metrics``."""
        return f"http://{self._server.server_address[0]}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, free the port, shut the meter provider down; idempotent."""
        if self._closed:
            return
        self._closed = True
        if _stats.listener is self.listener:
            _stats.set_listener(None)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self.meter_provider.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def serve_prometheus(port: int = 9464, host: str = "127.0.0.1", *,
                     tracer_provider: TracerProvider | None = None,
                     read_timeout: float = DEFAULT_READ_TIMEOUT,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS,
                     duration_sample_rate: float | None = None) -> PrometheusEndpoint:
    """Instrument the process and serve its metrics at ``http://host:port/metrics``
    (port 0: a free port, see ``endpoint.port``). ``tracer_provider``: where spans go
    (None: the global one). ``read_timeout``: seconds a connection may stay silent
    before it is closed; ``max_connections``: connections served at once (more are
    answered 503). ``duration_sample_rate``: the share of durations recorded in the
    duration histograms (None: :func:`instrument`'s default, 0.1; 1.0: every one)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigurationError(f"serve_prometheus port must be an int in 0..65535, "
                                 f"got {port!r}")
    check_bounds("serve_prometheus", read_timeout, max_connections)
    prometheus_client = require("prometheus_client", "otel")
    exporter = require("opentelemetry.exporter.prometheus", "otel")
    sdk_metrics = require("opentelemetry.sdk.metrics", "otel")
    from msgpatterns.observability.otel import DEFAULT_DURATION_SAMPLE_RATE, instrument

    registry = prometheus_client.CollectorRegistry()
    reader = exporter.PrometheusMetricReader(registry=registry)
    provider = sdk_metrics.MeterProvider(metric_readers=[reader])
    handler = prometheus_client.MetricsHandler.factory(registry)
    server = BoundedHTTPServer((host, port), handler, read_timeout=read_timeout,
                               max_connections=max_connections)
    thread = threading.Thread(target=server.serve_forever, name="msgpatterns-prometheus",
                              daemon=True)
    thread.start()
    listener = instrument(meter_provider=provider, tracer_provider=tracer_provider,
                          duration_sample_rate=DEFAULT_DURATION_SAMPLE_RATE
                          if duration_sample_rate is None else duration_sample_rate)
    return PrometheusEndpoint(server, thread, provider, listener)
