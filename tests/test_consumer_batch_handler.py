"""Batch handlers: ``Consumer(..., batch=True)`` hands the handler a list of messages and
settles every message on its own (retries, dead letters, attempt counts per message)."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from msgpatterns import (
    Backoff,
    Consumer,
    InMemoryBroker,
    Message,
    NeedRetry,
    Reject,
    RetryPolicy,
)
from msgpatterns.errors import ConfigurationError, PartialFailure
from msgpatterns.idempotency import LeaseChecker, MemoryChecker, idempotent
from msgpatterns.testing import EffectLog, assert_all_acked
from msgpatterns.testing.checker_fixtures import checker_for, store_params

QUICK = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1.0), local_retries=0)


def publish(broker: InMemoryBroker, count: int) -> list[str]:
    ids = [f"o-{i}" for i in range(count)]
    for message_id in ids:
        broker.publish("orders", {"id": message_id}, id=message_id)
    return ids


def consume(broker: InMemoryBroker, handler: Any, **options: Any) -> Consumer:
    consumer = Consumer(broker, handler, topics=["orders"], group="billing", batch=True,
                        **options)
    consumer.run_until_idle(timeout=60)
    return consumer


def test_the_handler_receives_the_fetched_messages_as_one_list() -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 10)
    batches: list[list[str | None]] = []

    def handle(messages: list[Message]) -> None:
        batches.append([m.id for m in messages])

    consumer = consume(broker, handle, fetch_batch=10)
    assert batches == [ids]
    assert consumer.stats.acked == 10
    assert_all_acked(broker)


def test_partial_failures_are_retried_one_by_one_with_their_own_attempt_counts() -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 8)
    calls: list[tuple[str | None, int]] = []

    def handle(messages: list[Message]) -> None:
        calls.extend((m.id, m.attempt) for m in messages)
        failures: dict[Message, BaseException] = {}
        for m in messages:
            if m.id in ("o-1", "o-5") and m.attempt == 1:
                failures[m] = ConnectionError("downstream down")
            elif m.id == "o-6" and m.attempt < 3:
                failures[m] = TimeoutError("slow")
        if failures:
            raise PartialFailure(failures)

    consumer = consume(broker, handle, retry=RetryPolicy(
        max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0), fetch_batch=8)
    by_id = Counter(message_id for message_id, _ in calls)
    assert by_id == Counter({**dict.fromkeys(ids, 1), "o-1": 2, "o-5": 2, "o-6": 3})
    assert sorted(a for i, a in calls if i == "o-6") == [1, 2, 3]
    assert consumer.stats.failed == 4 and consumer.stats.redelivered == 4
    assert consumer.stats.acked == 8
    assert_all_acked(broker)


def test_a_handler_that_raises_fails_every_message_of_the_batch() -> None:
    broker = InMemoryBroker()
    publish(broker, 4)
    attempts: list[int] = []

    def handle(messages: list[Message]) -> None:
        attempts.extend(m.attempt for m in messages)
        if messages[0].attempt == 1:
            raise ConnectionError("database down")

    consumer = consume(broker, handle, retry=QUICK)
    assert sorted(attempts) == [1] * 4 + [2] * 4
    assert consumer.stats.redelivered == 4 and consumer.stats.acked == 4


def test_dead_letters_are_per_message() -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 6)

    def handle(messages: list[Message]) -> None:
        for m in messages:
            if m.id == "o-2":
                m.ack(Reject("bad order"))  # settled by the handler: straight to DLQ
        poison = [m for m in messages if m.id == "o-4"]
        if poison:
            raise PartialFailure({poison[0]: ValueError("always fails")})

    consumer = consume(broker, handle, retry=QUICK)
    dead = {d.message.id: d for d in broker.dead_letters}
    assert set(dead) == {"o-2", "o-4"}
    assert dead["o-2"].attempts == 1 and "bad order" in dead["o-2"].reason
    assert dead["o-4"].attempts == 3 and dead["o-4"].error_type.endswith("ValueError")
    assert consumer.stats.acked == len(ids) - 2


def test_need_retry_without_delay_retries_that_message_in_process() -> None:
    broker = InMemoryBroker()
    publish(broker, 3)
    seen: list[tuple[str | None, int]] = []

    def handle(messages: list[Message]) -> None:
        seen.extend((m.id, m.local_retries) for m in messages)
        for m in messages:
            if m.id == "o-1" and m.local_retries == 0:
                raise PartialFailure({m: NeedRetry()})

    consumer = consume(broker, handle, retry=RetryPolicy(local_retries=2))
    assert sorted(seen) == [("o-0", 0), ("o-1", 0), ("o-1", 1), ("o-2", 0)]
    assert consumer.stats.retried_locally == 1 and consumer.stats.acked == 3


def test_max_in_flight_bounds_every_batch() -> None:
    broker = InMemoryBroker()
    publish(broker, 40)
    sizes: list[int] = []
    in_flight: list[int] = []
    consumer: Consumer | None = None

    def handle(messages: list[Message]) -> None:
        sizes.append(len(messages))
        assert consumer is not None
        in_flight.append(consumer.in_flight)

    consumer = Consumer(broker, handle, topics=["orders"], group="billing", batch=True,
                        workers=3, max_in_flight=7, fetch_batch=64)
    consumer.run_until_idle(timeout=60)
    assert sum(sizes) == 40
    assert max(sizes) <= 7 and max(in_flight) <= 7


def test_explicit_ack_per_message_in_a_batch() -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 5)
    parked: list[Message] = []

    def handle(messages: list[Message]) -> None:
        for m in messages:
            if m.id == "o-3":
                m.disable_auto_ack()
                parked.append(m)
                threading.Thread(target=m.ack).start()  # acked later, elsewhere

    consumer = consume(broker, handle)
    assert [m.id for m in parked] == ["o-3"]
    assert consumer.stats.acked == len(ids)
    assert_all_acked(broker)


def test_stop_hands_back_a_batch_in_progress() -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 6)
    running = threading.Event()
    release = threading.Event()
    handed_back: list[str | None] = []
    all_back = threading.Event()
    nack = broker.nack

    def counting_nack(message: Message, delay: float = 0.0) -> None:
        nack(message, delay)
        handed_back.append(message.id)
        if len(handed_back) == len(ids):
            all_back.set()

    broker.nack = counting_nack  # type: ignore[method-assign]

    def handle(messages: list[Message]) -> None:
        running.set()
        release.wait(10)

    consumer = Consumer(broker, handle, topics=["orders"], group="billing", batch=True)
    consumer.start()
    assert running.wait(10)
    stopper = threading.Thread(target=consumer.stop, args=(0,))
    stopper.start()
    assert all_back.wait(10)  # handed back while the handler still runs
    release.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert sorted(handed_back) == ids
    assert consumer.stats.released == len(ids) and consumer.stats.acked == 0
    assert consumer.in_flight == 0
    # Nothing was acked: every message is delivered again.
    again: list[str | None] = []
    consume(broker, lambda ms: again.extend(m.id for m in ms))
    assert sorted(again) == ids


def test_ordered_mode_refuses_a_batch_handler() -> None:
    with pytest.raises(ConfigurationError, match="ordered"):
        Consumer(InMemoryBroker(), lambda ms: None, topics=["t"], group="g", batch=True,
                 ordered=True)
    with pytest.raises(ConfigurationError, match="batch"):
        Consumer(InMemoryBroker(), lambda ms: None, topics=["t"], group="g",
                 batch="yes")  # type: ignore[arg-type]


def test_partial_failure_takes_exception_instances_only() -> None:
    message = Message(b"x", id="m")
    with pytest.raises(TypeError):
        PartialFailure({message: ValueError})  # type: ignore[dict-item]


@pytest.mark.parametrize("store", store_params("memory", "fakeredis", "sqlite", "redis",
                                               "postgres"))
def test_an_idempotent_batch_handler_gets_only_the_claimed_messages(
        store: str, tmp_path: Path) -> None:
    broker = InMemoryBroker()
    with checker_for(store, tmp_path) as checker:
        assert isinstance(checker, LeaseChecker)
        effects = EffectLog()
        sizes: list[int] = []

        @idempotent(checker, group="billing.batch")
        def handle(messages: list[Message]) -> None:
            sizes.append(len(messages))
            for m in messages:
                effects.record(m.id)
                if m.id == "o-3" and m.attempt == 1:
                    m.ack(ConnectionError("row lock timeout"))  # released, retried

        ids = publish(broker, 6)
        consume(broker, handle, retry=QUICK, fetch_batch=6)
        for message_id in ("o-0", "o-1", "new"):  # two duplicates, one new message
            broker.publish("orders", {"id": message_id}, id=message_id)
        consume(broker, handle, retry=QUICK, fetch_batch=6)
        assert Counter(effects.order) == Counter({**dict.fromkeys(ids, 1), "o-3": 2,
                                                  "new": 1})
        assert sizes == [6, 1, 1]  # the batch, o-3's retry, then only "new"
        assert checker.stats.duplicates == 2 and checker.stats.released == 1
        assert_all_acked(broker)


def test_batch_handler_refuses_store_result() -> None:
    @idempotent(MemoryChecker(), store_result=True)
    def handle(messages: list[Message]) -> None:
        pass

    with pytest.raises(ConfigurationError, match="store_result"):
        Consumer(InMemoryBroker(), handle, topics=["t"], group="g", batch=True)


@pytest.mark.redis
def test_a_batch_on_redis_streams_is_acked_with_one_call(redis_url: str, unique: str) -> None:
    import redis

    from msgpatterns.brokers import RedisStreamsBroker

    client = redis.Redis.from_url(redis_url)
    stream = f"batch-{unique}"
    broker = RedisStreamsBroker(client)
    calls: list[int] = []
    ack_many = broker.ack_many

    def counting(messages: Any) -> None:
        calls.append(len(messages))
        ack_many(messages)

    broker.ack_many = counting  # type: ignore[method-assign]
    try:
        ids = broker.publish_many(stream, [f"m{i}".encode() for i in range(20)])
        got: list[str | None] = []
        done = threading.Event()

        def handle(messages: list[Message]) -> None:
            got.extend(m.id for m in messages)
            if len(got) == 20:
                done.set()

        consumer = Consumer(broker, handle, topics=[stream], group="g", batch=True,
                            fetch_batch=20)
        consumer.start()
        assert done.wait(10)
        consumer.stop(10)
        broker.flush()
        assert sorted(got) == sorted(ids)
        assert calls == [20]
        assert client.xpending(stream, "g")["pending"] == 0
    finally:
        broker.close()
        for key in client.scan_iter(match=f"{stream}*"):
            client.delete(key)
        client.close()
