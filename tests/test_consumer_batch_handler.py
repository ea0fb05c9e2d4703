"""Batch handlers of the sync ``Consumer`` on more stores and on Redis Streams' one-call
acks. Their behaviour on both drivers - a list per call, each message settled on its own
(retries, dead letters, attempt counts, explicit acks, stops) - is in the parity suite
(``tests/parity/test_parity_batch.py``)."""

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
    RetryPolicy,
)
from msgpatterns.errors import PartialFailure
from msgpatterns.idempotency import LeaseChecker, idempotent
from msgpatterns.testing import EffectLog, assert_all_acked
from msgpatterns.testing.checker_fixtures import checker_for, store_params
from two_drivers import publish

QUICK = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1.0), local_retries=0)



def consume(broker: InMemoryBroker, handler: Any, **options: Any) -> Consumer:
    consumer = Consumer(broker, handler, topics=["orders"], group="billing", batch=True,
                        **options)
    consumer.run_until_idle(timeout=60)
    return consumer


def test_partial_failure_takes_exception_instances_only() -> None:
    message = Message(b"x", id="m")
    with pytest.raises(TypeError):
        PartialFailure({message: ValueError})  # type: ignore[dict-item]


@pytest.mark.parametrize("store", store_params("fakeredis", "sqlite", "postgres"))
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
