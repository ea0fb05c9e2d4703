"""The parity suite: every consumer-level behaviour, one test body, both drivers.

``driver`` runs each test on :class:`~msgpatterns.Consumer` and on
:class:`~msgpatterns.aio.AsyncConsumer` (see ``parity_drivers.py``); ``otel`` installs
OpenTelemetry with in-memory exporters for the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from parity_drivers import Driver, Otel, driver_named


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Iterator[Driver]:
    """Each driver in turn (the async one with an event loop thread of its own)."""
    with driver_named(request.param) as made:
        yield made


@pytest.fixture
def otel() -> Iterator[Otel]:
    pytest.importorskip("opentelemetry.sdk")
    from msgpatterns.observability import instrument, uninstrument

    o = Otel()
    # every duration recorded: the test counts the histogram against the deliveries
    instrument(tracer_provider=o.tracer_provider, meter_provider=o.meter_provider,
               duration_sample_rate=1.0)
    try:
        yield o
    finally:
        uninstrument()
