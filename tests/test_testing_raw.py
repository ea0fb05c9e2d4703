"""The raw-callback stand-ins drive pika-shaped and confluent-kafka-shaped loops from
the fake broker, with its faults; and the msgpatterns marker tunes the fake_broker
fixture."""

from __future__ import annotations

from typing import Any

import pytest

from msgpatterns import InMemoryBroker, MemoryChecker, idempotent
from msgpatterns.testing import FakeKafkaConsumer, FakePikaChannel


def publish_orders(broker: InMemoryBroker, n: int = 20) -> None:
    for i in range(n):
        broker.publish("payments", f'{{"id": {i}}}'.encode(), key=f"p{i}")


def test_a_pika_callback_runs_to_completion_with_duplicates_and_lost_acks() -> None:
    broker = InMemoryBroker(seed=4, duplicate_rate=0.4, lost_ack_rate=0.2)
    publish_orders(broker)
    charged: list[str] = []
    checker = MemoryChecker()

    @idempotent(checker, key=lambda ch, method, props, body: props.correlation_id)
    def charge(ch: Any, method: Any, props: Any, body: bytes) -> None:
        charged.append(props.correlation_id)

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        charge(ch, method, props, body)
        ch.basic_ack(method.delivery_tag)

    channel = FakePikaChannel(broker, group="billing")
    channel.basic_qos(prefetch_count=5)
    channel.basic_consume("payments", on_message_callback=on_message)
    channel.start_consuming()
    assert sorted(charged) == sorted(f"p{i}" for i in range(20))
    assert broker.pending == 0
    assert broker.stats.duplicates > 0 or broker.stats.lost_acks > 0  # faults happened


def test_pika_nack_requeues_reject_dead_letters_and_unsettled_comes_back() -> None:
    broker = InMemoryBroker(seed=1, visibility_timeout=30)
    for body in (b"retry-me", b"poison", b"forget-me"):
        broker.publish("q", body)
    seen: list[tuple[bytes, bool]] = []

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        seen.append((body, method.redelivered))
        if body == b"poison":
            ch.basic_reject(method.delivery_tag, requeue=False)
        elif method.redelivered:
            ch.basic_ack(method.delivery_tag)
        elif body == b"retry-me":
            ch.basic_nack(method.delivery_tag, requeue=True)
        # forget-me: never settled on its first delivery

    channel = FakePikaChannel(broker)
    channel.basic_consume("q", on_message)
    channel.start_consuming()
    assert sorted(seen) == [(b"forget-me", False), (b"forget-me", True), (b"poison", False),
                            (b"retry-me", False), (b"retry-me", True)]
    [dead] = broker.dead_letters
    assert dead.message.raw_body == b"poison"
    assert broker.pending == 0


def test_a_kafka_poll_loop_commits_and_rereads_what_it_did_not_commit() -> None:
    broker = InMemoryBroker(seed=2, duplicate_rate=0.3)
    publish_orders(broker, 10)
    consumer = FakeKafkaConsumer(broker, group="billing")
    consumer.subscribe(["payments"])
    values: list[bytes] = []
    skipped_once = False
    while (record := consumer.poll(1.0)) is not None:
        if record.key() == b"p3" and not skipped_once:
            skipped_once = True  # crash before commit: p3 comes back
            continue
        values.append(record.value())
        consumer.commit(message=record)
    consumer.close()
    assert set(values) == {f'{{"id": {i}}}'.encode() for i in range(10)}
    assert skipped_once and broker.pending == 0


@pytest.mark.msgpatterns(duplicate_rate=0.5, lost_ack_rate=0.3, reorder_window=4, seed=11)
def test_the_marker_configures_the_fixture(fake_broker: InMemoryBroker) -> None:
    assert (fake_broker.duplicate_rate, fake_broker.lost_ack_rate,
            fake_broker.reorder_window) == (0.5, 0.3, 4)


def test_without_the_marker_the_fixture_injects_nothing(fake_broker: InMemoryBroker) -> None:
    assert (fake_broker.duplicate_rate, fake_broker.lost_ack_rate,
            fake_broker.reorder_window) == (0.0, 0.0, 0)


def test_an_unknown_marker_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="""
        import pytest

        @pytest.mark.msgpatterns(duplicates=0.5)
        def test_x(fake_broker):
            pass
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*unknown option(s)*duplicates*"])
    assert result.ret != 0
