"""The parity suite: every consumer-level behaviour, one test body, both drivers.

``driver`` runs each test on :class:`~msgpatterns.Consumer` and on
:class:`~msgpatterns.aio.AsyncConsumer` (see ``tests/two_drivers.py``); ``otel``
installs OpenTelemetry with in-memory exporters for the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from two_drivers import Driver, Otel, driver_named, installed_otel


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Iterator[Driver]:
    """Each driver in turn (the async one with an event loop thread of its own)."""
    with driver_named(request.param) as made:
        yield made


@pytest.fixture
def otel() -> Iterator[Otel]:
    with installed_otel() as o:
        yield o
