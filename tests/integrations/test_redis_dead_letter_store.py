"""RedisDeadLetterStore: records the Redis Streams admin (``msgpatterns dlq``) reads, a
clear error when Redis is down, no password in its repr, replays handed back."""

from __future__ import annotations

import pytest

pytest.importorskip("redis")

import redis

from msgpatterns import Message
from msgpatterns.brokers import RedisStreamsBroker
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import BrokerUnavailable, ConfigurationError
from msgpatterns.integrations.deadletters import RedisDeadLetterStore


def record(topic: str, mid: str) -> DeadLetter:
    message = Message(b'{"n": 1}', id=mid, key="k", topic=topic, headers={"h": "v"},
                      attempt=3)
    return DeadLetter.from_error(message, ValueError("boom"), now=1.0, group="g",
                                 reason="gave up")


@pytest.mark.redis
def test_records_are_read_by_the_admin_and_replays_come_back(redis_url: str,
                                                             unique: str) -> None:
    topic = f"store-{unique}"
    client = redis.Redis.from_url(redis_url)
    store = RedisDeadLetterStore(client)
    adapter = RedisStreamsBroker(redis_url)
    try:
        store.put(record(topic, "m-1"))
        store.put(record(topic, "m-2"))
        admin = adapter.dead_letter_admin()
        listed = admin.list_dead_letters(topic)
        assert [r.id for r in listed] == ["m-1", "m-2"]
        assert listed[0].attempts == 3 and listed[0].group == "g"
        assert listed[0].message.raw_body == b'{"n": 1}'
        assert admin.replay_dead_letters(topic, ids=["m-1"]) == 1  # to g's retries
        assert admin.replay_dead_letters(topic, ids=["m-2"], to_topic=True) == 1
        sent: list[Message] = []
        assert store.take_replays(topic, "g", sent.append) == 2
        assert [(m.id, m.key, m.attempt, m.headers.get("h")) for m in sent] == [
            ("m-1", "k", 1, "v"), ("m-2", "k", 1, "v")]
        assert store.take_replays(topic, "g", sent.append) == 0
    finally:
        client.delete(topic, f"{topic}:dlq", f"{topic}:retry:g")
        client.close()
        adapter.close()


@pytest.mark.redis
def test_a_failing_send_leaves_the_replay_in_place(redis_url: str, unique: str) -> None:
    topic = f"store-{unique}"
    client = redis.Redis.from_url(redis_url)
    store = RedisDeadLetterStore(client)
    adapter = RedisStreamsBroker(redis_url)
    try:
        store.put(record(topic, "m-1"))
        adapter.dead_letter_admin().replay_dead_letters(topic)

        def down(message: Message) -> None:
            raise ConnectionError("celery broker down")

        with pytest.raises(ConnectionError):
            store.take_replays(topic, "g", down)
        assert client.xlen(f"{topic}:retry:g") == 1  # still there, sent next time
    finally:
        client.delete(topic, f"{topic}:dlq", f"{topic}:retry:g")
        client.close()
        adapter.close()


def test_unreachable_redis_is_a_clear_error_without_the_password() -> None:
    store = RedisDeadLetterStore("redis://user:s3cret@127.0.0.1:1/0")
    try:
        assert "s3cret" not in repr(store)
        with pytest.raises(BrokerUnavailable) as info:
            store.put(record("t", "m-1"))
        assert "s3cret" not in str(info.value)
    finally:
        store.close()
    with pytest.raises(ConfigurationError):
        RedisDeadLetterStore(42)  # type: ignore[arg-type]
