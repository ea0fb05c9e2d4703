"""``@idempotent`` on Consumer handlers, raw pika callbacks and confluent-kafka messages,
with exactly-once effects under duplicates, lost acks and reordering."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from pika.spec import Basic, BasicProperties

from msgpatterns import Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.errors import ConfigurationError, IdempotencyConflict, MalformedMessage
from msgpatterns.idempotency import Checker, MemoryChecker, idempotent
from msgpatterns.retry import Backoff
from msgpatterns.testing import EffectLog, assert_all_acked, assert_dead_lettered
from msgpatterns.testing.checker_fixtures import STORES, checker_for, store_params

ALL_STORES = store_params(*STORES)
QUICK = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0)


@pytest.fixture(params=ALL_STORES)
def checker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Checker]:
    with checker_for(request.param, tmp_path) as built:
        yield built


def run(broker: InMemoryBroker, handler: Any, **kwargs: Any) -> Consumer:
    consumer = Consumer(broker, handler, topics=["orders"], group="billing", **kwargs)
    consumer.run_until_idle(timeout=60)
    return consumer


# -- end to end through the Consumer ---------------------------------------------------------

def test_exactly_once_effects_under_duplicates_lost_acks_and_reordering(
    checker: Checker,
) -> None:
    broker = InMemoryBroker(seed=7, duplicate_rate=0.3, lost_ack_rate=0.2, reorder_window=4)
    keys = [f"order-{i}" for i in range(80)]
    for key in keys:
        broker.publish("orders", {"key": key}, key=key)
    effects = EffectLog()

    @idempotent(checker)
    def handle(message: Message) -> None:
        effects.record(message.key)

    run(broker, handle, workers=4, retry=QUICK)
    effects.assert_exactly_once(keys)
    assert_all_acked(broker)
    assert broker.stats.duplicates > 0 and broker.stats.lost_acks > 0
    assert checker.stats.duplicates >= broker.stats.duplicates


def test_a_failed_attempt_releases_the_key_and_the_redelivery_applies_it(
    checker: Checker,
) -> None:
    broker = InMemoryBroker(seed=1)
    for i in range(10):
        broker.publish("orders", i, key=f"k{i}")
    effects = EffectLog()
    failed: set[str] = set()

    @idempotent(checker)
    def handle(message: Message) -> None:
        assert message.key is not None
        if message.key not in failed:
            failed.add(message.key)
            raise RuntimeError("database hiccup")
        effects.record(message.key)

    run(broker, handle, retry=QUICK)
    effects.assert_exactly_once(f"k{i}" for i in range(10))
    assert_all_acked(broker)
    assert checker.stats.released == 10


def test_duplicates_are_acked_logged_at_debug_and_counted_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = InMemoryBroker(seed=1)
    checker = MemoryChecker()
    first = broker.publish("orders", b"pay 10", key="order-1")
    second = broker.publish("orders", b"pay 10", key="order-1")  # resent by the producer
    effects = EffectLog()

    @idempotent(checker)
    def handle(message: Message) -> None:
        effects.record(message.id)

    with caplog.at_level(logging.DEBUG, logger="msgpatterns.idempotency"):
        run(broker, handle)
    assert effects.order == [first]
    assert {m.id for m in broker.acked} == {first, second}
    assert checker.stats.duplicates == 1
    assert any(r.levelno == logging.DEBUG and "duplicate" in r.getMessage()
               for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_live_duplicate_waits_for_the_lease_then_takes_over_a_dead_owner() -> None:
    broker = InMemoryBroker(seed=1)
    checker = MemoryChecker(lease=120, clock=broker.clock.now)
    group = f"{__name__}.handle"
    orphan = checker.claim("order-1", group=group)  # its owner died without completing
    assert orphan.claimed
    broker.publish("orders", b"x", key="order-1")
    attempts: list[int] = []

    @idempotent(checker, group=group)
    def handle(message: Message) -> None:
        attempts.append(message.attempt)

    start = broker.clock.now()
    run(broker, handle, retry=QUICK)
    assert attempts == [2]  # attempt 1 met the live lease and got InProgress
    assert broker.clock.now() - start >= 119  # redelivered when the lease ran out
    assert checker.stats.in_progress == 1
    assert_all_acked(broker)


def test_same_key_with_another_payload_is_dead_lettered_as_a_conflict(checker: Checker) -> None:
    broker = InMemoryBroker(seed=1)
    broker.publish("orders", b'{"amount": 10}', key="order-1")
    broker.publish("orders", b'{"amount": 10}', key="order-1")
    broker.publish("orders", b'{"amount": 99}', key="order-1")
    effects = EffectLog()

    @idempotent(checker, fingerprint=True)
    def handle(message: Message) -> None:
        effects.record(message.key)

    run(broker, handle, retry=QUICK)
    effects.assert_exactly_once(["order-1"])
    (dead,) = assert_dead_lettered(broker, 1, reason="fingerprint")
    assert dead.message.raw_body == b'{"amount": 99}'
    assert dead.error_type.endswith("IdempotencyConflict")
    assert checker.stats.conflicts == 1


def test_a_message_without_a_usable_key_is_dead_lettered_and_the_rest_goes_on() -> None:
    broker = InMemoryBroker(seed=1)
    broker.publish("orders", {"order_id": "o-1"})
    broker.publish("orders", {"no_id": True})
    broker.publish("orders", {"order_id": "o-2"})
    effects = EffectLog()

    @idempotent(MemoryChecker(), key=lambda m: m.body["order_id"])
    def handle(message: Message) -> None:
        effects.record(message.body["order_id"])

    run(broker, handle, retry=QUICK)
    effects.assert_exactly_once(["o-1", "o-2"])
    (dead,) = assert_dead_lettered(broker, 1, reason="idempotency key")
    assert dead.error_type.endswith("MalformedMessage")


# -- any handler shape -------------------------------------------------------------------------

class FakeChannel:
    """Records what a pika callback does with its channel."""

    def __init__(self) -> None:
        self.acked: list[int] = []

    def basic_ack(self, delivery_tag: int) -> None:
        self.acked.append(delivery_tag)


def test_raw_pika_callback_with_a_key_from_properties_and_ack_on_duplicate() -> None:
    checker = MemoryChecker()
    effects = EffectLog()

    def ack(ch: FakeChannel, method: Basic.Deliver, props: BasicProperties, body: bytes) -> None:
        ch.basic_ack(method.delivery_tag)

    @idempotent(checker, key=lambda ch, method, props, body: props.message_id,
                on_duplicate=ack)
    def on_message(ch: FakeChannel, method: Basic.Deliver, props: BasicProperties,
                   body: bytes) -> None:
        effects.record(body)
        ch.basic_ack(method.delivery_tag)

    channel = FakeChannel()
    props = BasicProperties(message_id="m-1")
    on_message(channel, Basic.Deliver(delivery_tag=1), props, b"pay")
    on_message(channel, Basic.Deliver(delivery_tag=2, redelivered=True), props, b"pay")
    assert effects.order == [b"pay"]
    assert channel.acked == [1, 2]  # the duplicate is acked too, never left hanging


def test_confluent_kafka_message_with_key_and_fingerprint_from_the_message() -> None:
    checker = MemoryChecker()
    effects = EffectLog()

    @idempotent(checker, key=lambda msg: msg.key(), fingerprint=lambda msg: msg.value())
    def handle(msg: confluent_kafka.Message) -> str:
        effects.record((msg.key(), msg.offset()))
        return "applied"

    def message(offset: int, value: bytes) -> confluent_kafka.Message:
        return confluent_kafka.Message(topic="orders", partition=0, offset=offset,
                                       key=b"order-1", value=value)

    assert handle(message(5, b"pay 10")) == "applied"
    assert handle(message(6, b"pay 10")) is None  # the producer's retry: skipped
    with pytest.raises(IdempotencyConflict):
        handle(message(7, b"pay 99"))
    assert effects.order == [(b"order-1", 5)]


def test_each_handler_has_its_own_group_by_default() -> None:
    checker = MemoryChecker()
    effects = EffectLog()

    @idempotent(checker)
    def bill(message: Message) -> None:
        effects.record(("bill", message.key))

    @idempotent(checker)
    def ship(message: Message) -> None:
        effects.record(("ship", message.key))

    message = Message(b"x", key="order-1")
    for handler in (bill, ship, bill, ship):
        handler(message)
    effects.assert_exactly_once([("bill", "order-1"), ("ship", "order-1")])
    assert (checker.stats.claimed, checker.stats.duplicates) == (2, 2)


def test_methods_find_their_message_after_self_and_keep_their_metadata() -> None:
    checker = MemoryChecker()

    class Billing:
        def __init__(self) -> None:
            self.charged: list[str | None] = []

        @idempotent(checker, group="billing")
        def handle(self, message: Message) -> str:
            """Charge an order."""
            self.charged.append(message.key)
            return "charged"

    billing = Billing()
    assert billing.handle(Message(b"", key="o-1")) == "charged"
    assert billing.handle(Message(b"", key="o-1")) is None
    assert billing.handle(Message(b"", id="m-9")) == "charged"  # no key: the message id
    assert billing.charged == ["o-1", None]
    assert Billing.handle.__doc__ == "Charge an order."
    assert Billing.handle.__name__ == "handle"


def test_a_handler_without_a_message_needs_a_key_callable() -> None:
    @idempotent(MemoryChecker())
    def handle(payload: dict[str, Any]) -> None:
        raise AssertionError("must not run")

    with pytest.raises(ConfigurationError, match="key="):
        handle({"id": 1})


def test_a_key_callable_that_fails_raises_malformed_message() -> None:
    @idempotent(MemoryChecker(), key=lambda m: m.headers["order-id"])
    def handle(message: Message) -> None:
        raise AssertionError("must not run")

    with pytest.raises(MalformedMessage, match="order-id"):
        handle(Message(b""))


def test_a_bad_group_fails_when_decorating() -> None:
    with pytest.raises(ConfigurationError, match="group"):
        idempotent(MemoryChecker(), group="a:b")(lambda m: None)
