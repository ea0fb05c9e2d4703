"""Parity: misuse refused at construction (DESIGN 11 "Errors" and "Callables") - the
wrong kind of handler, decoder or broker, and bad options - on both drivers, one test
body each."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from msgpatterns import InMemoryBroker
from msgpatterns.errors import ConfigurationError
from two_drivers import Driver

OTHER = {"sync": r"msgpatterns\.AsyncConsumer", "async": r"msgpatterns\.Consumer"}


def test_the_wrong_kind_of_handler_is_refused_naming_the_other_driver(
        driver: Driver) -> None:
    with pytest.raises(TypeError, match=OTHER[driver.name]):
        driver.consumer(InMemoryBroker(), driver.wrong_handler())


def test_the_wrong_kind_of_broker_is_refused(driver: Driver) -> None:
    from msgpatterns.aio import AsyncInMemoryBroker

    wrong = InMemoryBroker() if driver.is_async else AsyncInMemoryBroker()
    handler = driver.handler(lambda m: None)
    with pytest.raises(ConfigurationError, match="Broker protocol"):
        driver.build(lambda: _consumer_class(driver)(wrong, handler, topics=["t"],
                                                     group="g"))


def test_an_async_decoder_is_refused_where_it_cannot_be_awaited(driver: Driver) -> None:
    async def decode(raw: bytes) -> Any:
        await asyncio.sleep(0)
        return raw.decode()

    if driver.is_async:  # awaited: accepted (a plain decoder is too)
        broker = InMemoryBroker()
        broker.publish("t", b"x")
        seen: list[Any] = []
        driver.consumer(broker, driver.handler(lambda m: seen.append(m.body)),
                        decoder=decode).run_until_idle(10)
        assert seen == ["x"]
        return
    with pytest.raises(TypeError, match=OTHER[driver.name]):
        driver.consumer(InMemoryBroker(), driver.handler(lambda m: None), decoder=decode)


def test_a_handler_that_is_not_callable_is_refused(driver: Driver) -> None:
    with pytest.raises(ConfigurationError, match="callable"):
        driver.consumer(InMemoryBroker(), "handle")  # type: ignore[arg-type]


@pytest.mark.parametrize("option", [{"max_in_flight": 0}, {"poll_timeout": 0},
                                    {"group": ""}, {"topics": []}, {"ack_timeout": -1},
                                    {"fetch_batch": 0}, {"retry": "3 times"},
                                    {"dead_letters": object()}, {"name": ""},
                                    {"shutdown_timeout": float("nan")}])
def test_bad_options_are_refused(driver: Driver, option: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        driver.consumer(InMemoryBroker(), driver.handler(lambda m: None), **option)


def _consumer_class(driver: Driver) -> Any:
    from msgpatterns import Consumer
    from msgpatterns.aio import AsyncConsumer

    return AsyncConsumer if driver.is_async else Consumer
