"""DESIGN 2: auto ack, explicit ack from any thread, double ack, raise after disabling
auto ack, and the ack deadline."""

from __future__ import annotations

import logging
import threading

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message, Reject, RetryPolicy
from msgpatterns.errors import AckTimeout
from msgpatterns.testing import assert_all_acked


def test_auto_ack_acks_when_the_handler_returns(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")
    Consumer(fake_broker, lambda m: None, topics=["t"], group="g").run_until_idle(timeout=10)
    assert_all_acked(fake_broker)


def test_explicit_ack_from_another_thread(fake_broker: InMemoryBroker) -> None:
    ids = [fake_broker.publish("t", f"{i}".encode()) for i in range(20)]
    handed_over: list[Message] = []
    go = threading.Event()

    def handler(message: Message) -> None:
        message.disable_auto_ack()
        handed_over.append(message)
        if len(handed_over) == len(ids):
            go.set()

    def acker() -> None:
        go.wait(10)
        for message in handed_over:
            message.ack()

    thread = threading.Thread(target=acker)
    thread.start()
    consumer = Consumer(fake_broker, handler, topics=["t"], group="g", max_in_flight=50)
    consumer.run_until_idle(timeout=10)
    thread.join()
    assert {m.id for m in fake_broker.acked} == set(ids)
    assert all(m.succeeded for m in handed_over)
    assert_all_acked(fake_broker)


def test_unacked_explicit_messages_are_still_in_flight(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")
    held: list[Message] = []
    started = threading.Event()

    def handler(message: Message) -> None:
        message.disable_auto_ack()
        held.append(message)
        started.set()

    consumer = Consumer(fake_broker, handler, topics=["t"], group="g")
    consumer.start()
    assert started.wait(10)
    assert consumer.in_flight == 1
    assert fake_broker.acked == []
    held[0].ack()
    assert consumer.in_flight == 0
    consumer.stop(5)
    assert_all_acked(fake_broker)


def test_second_ack_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    outcomes: list[BaseException | None] = []
    message = Message(b"x", id="m1")
    message.bind(lambda m, error: outcomes.append(error))
    assert message.ack() is True
    with caplog.at_level(logging.WARNING, logger="msgpatterns.message"):
        assert message.ack(ValueError("late failure")) is False
    assert outcomes == [None]  # the first outcome stands
    assert message.succeeded
    assert "m1" in caplog.text and "ignored" in caplog.text


def test_ack_error_goes_through_the_retry_policy(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")

    def handler(message: Message) -> None:
        message.disable_auto_ack()
        message.ack(Reject("downstream said no"))

    Consumer(fake_broker, handler, topics=["t"], group="g").run_until_idle(timeout=10)
    (dead,) = fake_broker.dead_letters
    assert "downstream said no" in dead.reason
    assert fake_broker.pending == 0


def test_handler_raising_after_disabling_auto_ack_fails_the_delivery(
    fake_broker: InMemoryBroker, caplog: pytest.LogCaptureFixture
) -> None:
    fake_broker.publish("t", b"x")
    first_delivery: list[Message] = []

    def handler(message: Message) -> None:
        message.disable_auto_ack()
        if message.attempt == 1:
            first_delivery.append(message)
            raise RuntimeError("crashed before acking")
        message.ack()

    consumer = Consumer(fake_broker, handler, topics=["t"], group="g")
    consumer.run_until_idle(timeout=10)
    attempts = [e.attempt for e in fake_broker.history if e.kind == "deliver"]
    assert attempts == [1, 2]  # the failure was redelivered
    with caplog.at_level(logging.WARNING, logger="msgpatterns.message"):
        assert first_delivery[0].ack() is False  # a late ack of the failed delivery
    assert "ignored" in caplog.text
    assert isinstance(first_delivery[0].ack_error, RuntimeError)
    assert_all_acked(fake_broker)


def test_forgotten_ack_fails_at_the_deadline_with_a_warning(
    fake_broker: InMemoryBroker, caplog: pytest.LogCaptureFixture
) -> None:
    message_id = fake_broker.publish("t", b"x")

    def forgetful_handler(message: Message) -> None:
        message.disable_auto_ack()  # ... and never acks

    consumer = Consumer(
        fake_broker, forgetful_handler, topics=["t"], group="g",
        ack_timeout=0.05, retry=RetryPolicy(max_attempts=1),
    )
    with caplog.at_level(logging.WARNING, logger="msgpatterns.consumer"):
        consumer.run_until_idle(timeout=10)
    (dead,) = fake_broker.dead_letters
    assert dead.error_type.endswith("AckTimeout")
    assert consumer.stats.ack_timeouts == 1
    warning = next(r for r in caplog.records if "not acked within" in r.getMessage())
    assert message_id in warning.getMessage()
    assert "forgetful_handler" in warning.getMessage()


def test_forgotten_ack_is_redelivered_and_can_then_succeed(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")

    def handler(message: Message) -> None:
        if message.attempt == 1:
            message.disable_auto_ack()  # forgets; the deadline fails it

    consumer = Consumer(fake_broker, handler, topics=["t"], group="g", ack_timeout=0.05)
    consumer.run_until_idle(timeout=10)
    assert consumer.stats.ack_timeouts == 1
    assert_all_acked(fake_broker)


def test_expire_loses_to_an_earlier_ack() -> None:
    message = Message(b"x")
    message.ack()
    assert message.delivery.expire(message, AckTimeout("too late")) is False
    assert message.succeeded


def _race_to_settle(errors: list[BaseException | None]) -> list[BaseException | None]:
    outcomes: list[BaseException | None] = []
    message = Message(b"x")
    message.bind(lambda m, error: outcomes.append(error))
    barrier = threading.Barrier(len(errors))

    def settle(error: BaseException | None) -> None:
        barrier.wait()
        message.ack(error)

    threads = [threading.Thread(target=settle, args=(e,)) for e in errors]
    logging.disable(logging.WARNING)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        logging.disable(logging.NOTSET)
    return outcomes


def test_settlement_is_exactly_once_under_racing_threads() -> None:
    for _ in range(50):
        outcomes = _race_to_settle([None, ValueError("a"), ValueError("b"), None])
        assert len(outcomes) == 1
