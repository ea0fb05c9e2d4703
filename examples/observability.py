"""Observability: OpenTelemetry spans and metrics, Prometheus /metrics, health probes.

Runs on embedded defaults (the in-memory broker, ports chosen by the OS):

    pip install "msgpatterns[otel]" opentelemetry-sdk opentelemetry-exporter-prometheus \
        prometheus-client
    python examples/observability.py

It serves Prometheus metrics and /livez, /readyz, consumes a few messages (one of
them poison), then scrapes both endpoints and prints what a monitoring system sees.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from msgpatterns import Consumer, InMemoryBroker, Message, Reject
from msgpatterns.observability import HealthServer, serve_prometheus, trace_headers


def handle(message: Message) -> None:
    if message.body == "poison":
        raise Reject("cannot parse the order")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def main() -> None:
    # Log lines about a message carry message_id, topic, group and attempt as extra
    # fields (a JSON formatter picks them up as they are); fill them in for the others.
    def with_defaults(record: logging.LogRecord) -> bool:
        for name in ("message_id", "topic", "group", "attempt"):
            record.__dict__.setdefault(name, "-")
        return True

    handler = logging.StreamHandler()
    handler.addFilter(with_defaults)
    handler.setFormatter(logging.Formatter(
        "%(levelname)s %(message)s [id=%(message_id)s topic=%(topic)s group=%(group)s "
        "attempt=%(attempt)s]"))
    logging.basicConfig(level=logging.ERROR, handlers=[handler])
    spans = InMemorySpanExporter()  # in production: an OTLP exporter
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))

    broker = InMemoryBroker()
    consumer = Consumer(broker, handle, topics=["orders"], group="billing")
    with serve_prometheus(port=0, tracer_provider=tracer_provider) as metrics, \
            HealthServer(consumer, port=0) as probes:
        tracer = tracer_provider.get_tracer("shop")
        with tracer.start_as_current_span("checkout", kind=trace.SpanKind.PRODUCER):
            for body in ("a", "b", "poison", "c"):
                broker.publish("orders", body, headers=trace_headers())
        print("readyz before start:", get(probes.url + "/readyz")[0])
        stats = consumer.run_until_idle(timeout=10)
        print("consumer stats:", stats.as_dict())
        status, body = get(probes.url + "/livez")
        print("livez after stop:", status, json.loads(body)["consumers"][0]["state"])
        _, text = get(metrics.url)
        for line in text.splitlines():
            if line.startswith(("msgpatterns_consumer_deliveries_total",
                                "messaging_process_duration_seconds_count")):
                print(line)
    for span in spans.get_finished_spans():
        attrs = span.attributes or {}
        print(f"span {span.name!r} outcome={attrs.get('messaging.msgpatterns.outcome')} "
              f"trace={span.context.trace_id:032x}")


if __name__ == "__main__":
    main()
