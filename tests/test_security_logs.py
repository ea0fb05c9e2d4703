"""Issue 25 item 5: text from a message never forges or colours a log line.

A hostile producer puts a newline, a fake ``CRITICAL`` line and ANSI/OSC sequences into
a message's body and key; the handler fails with that text (transiently, then for good)
and the message is dead-lettered with it as its reason. Through the real ``Consumer``
and ``AsyncConsumer`` on the real Redis, and a foreign (raw ``XADD``) entry that cannot
be decoded: every msgpatterns log *message* holds the text escaped; the structured
``extra`` fields keep the exact values.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import anyio
import pytest

from broker_harness import eventually
from msgpatterns import Backoff, Consumer, Message, Reject, RetryPolicy
from msgpatterns._escape import escape_control

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

redis = pytest.importorskip("redis")

FORGED = "\n2026-01-01 00:00:00 CRITICAL msgpatterns: forged\r\x1b[31mred\x1b]0;title\x07"
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
RETRY = RetryPolicy(max_attempts=2, backoff=Backoff.fixed(0.01), local_retries=0)


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[Captured]:
    handler = Captured()
    root = logging.getLogger("msgpatterns")
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(previous)


@pytest.fixture
def topic(redis_url: str, unique: str) -> Iterator[str]:
    name = f"seclog-{unique}"
    yield name
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{name}*"):
        client.delete(key)
    client.close()


def handler(message: Message) -> None:
    text = message.raw_body.decode()
    if text.startswith("reject"):
        raise Reject(f"refused {text}")
    raise ValueError(f"failed on {text}")  # transient, then dead-lettered after 2


def assert_escaped(captured: Captured) -> None:
    messages = [r.getMessage() for r in captured.records if r.name.startswith("msgpatterns")]
    assert messages
    for text in messages:
        assert not CONTROL.search(text), text
    dead = [r for r in captured.records if "dead-lettered" in r.getMessage()]
    assert len(dead) == 2, messages
    assert any(escape_control(FORGED) in r.getMessage() for r in dead)
    failed = [r for r in captured.records if "failed on message" in r.getMessage()]
    assert failed and all(escape_control(FORGED) in r.getMessage() for r in failed)
    # the structured fields stay the exact values
    assert all(r.__dict__.get("topic", "").startswith("seclog-") for r in dead)


def test_consumer_escapes_message_text_in_log_lines(
        redis_url: str, topic: str, captured: Captured) -> None:
    """Issue 25 item 5 (thread driver): the dead-lettered and the handler-failed lines
    escape the reason and the error; no line is forged."""
    from msgpatterns.brokers import RedisStreamsBroker

    with RedisStreamsBroker(redis_url) as broker:
        broker.publish(topic, f"reject{FORGED}".encode(), key=f"k{FORGED}")
        broker.publish(topic, f"fail{FORGED}".encode(), key=f"k{FORGED}")
        consumer = Consumer(broker, handler, topics=[topic], group="g", retry=RETRY,
                            poll_timeout=0.05)
        consumer.start()
        try:
            eventually(lambda: len(broker.list_dead_letters(topic, "g")) == 2, timeout=30)
        finally:
            consumer.stop(timeout=30)
    assert_escaped(captured)


@pytest.mark.anyio
async def test_async_consumer_escapes_message_text_in_log_lines(
        redis_url: str, topic: str, captured: Captured) -> None:
    """Issue 25 item 5 (asyncio driver): as the thread driver."""
    from msgpatterns.aio import AsyncConsumer
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker
    from msgpatterns.brokers import RedisStreamsBroker

    async def async_handler(message: Message) -> None:
        handler(message)

    async with AsyncRedisStreamsBroker(redis_url) as broker:
        await broker.publish(topic, f"reject{FORGED}".encode(), key=f"k{FORGED}")
        await broker.publish(topic, f"fail{FORGED}".encode(), key=f"k{FORGED}")
        consumer = AsyncConsumer(broker, async_handler, topics=[topic], group="g",
                                 retry=RETRY)
        with RedisStreamsBroker(redis_url) as sync:
            await consumer.start()
            try:
                for _ in range(3000):
                    if len(sync.list_dead_letters(topic, "g")) == 2:
                        break
                    await anyio.sleep(0.01)
            finally:
                await consumer.stop(timeout=30)
            assert len(sync.list_dead_letters(topic, "g")) == 2
    assert_escaped(captured)


def test_foreign_undecodable_entry_is_logged_escaped(
        redis_url: str, topic: str, captured: Captured) -> None:
    """Issue 25 item 5: a raw XADD whose fields cannot be decoded is dead-lettered; the
    error line quoting it is escaped."""
    from msgpatterns.brokers import RedisStreamsBroker

    foreign = redis.Redis.from_url(redis_url)
    with RedisStreamsBroker(redis_url) as broker:
        broker.subscribe(topic, "g")
        foreign.xadd(topic, {"body": b"x", "headers": FORGED.encode()})
        assert broker.fetch([topic], "g", max_messages=10, timeout=1) == []
        assert len(broker.list_dead_letters(topic, "g")) == 1
    foreign.close()
    lines = [r.getMessage() for r in captured.records if "undecodable" in r.getMessage()]
    assert lines, [r.getMessage() for r in captured.records]
    for text in lines:
        assert not CONTROL.search(text), text
