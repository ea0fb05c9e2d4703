"""The ``max_message_bytes`` bound (:mod:`msgpatterns.limits`), and messages that are
huge in other ways: 100,000 headers, headers nested 100,000 deep.

The helper's unit tests, then foreign ``XADD`` entries on the real Redis (sync and
async adapters): each ends with the hostile entry dead-lettered with a reason or
delivered, and the next entry delivered - never a fetch that fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from msgpatterns.errors import ConfigurationError, MalformedMessage, Reject
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MessageTooLarge,
    check_max_message_bytes,
    check_message_size,
    message_size,
    oversize_reason,
)

MANY = {f"h{i}": "v" for i in range(100_000)}
DEEP = b"[" * 100_000 + b"]" * 100_000


def test_message_size_counts_body_headers_and_key() -> None:
    assert message_size(b"abc") == 3
    assert message_size("abc", {"ab": "cd"}, key="k") == 3 + 4 + 1
    assert message_size(b"", [("ab", b"cd"), ("e", None)]) == 5
    assert message_size("é", {"x": 12}) == 2 + 1 + 2  # UTF-8 bytes; a number as text
    assert message_size(memoryview(b"12345"), None, key=b"kk") == 7
    assert message_size(b"", MANY) == sum(len(k) + 1 for k in MANY)


def test_oversize_reason_names_the_size_and_the_bound() -> None:
    assert oversize_reason(b"x" * 10, limit=10) is None
    assert oversize_reason(b"x" * 10, limit=None) is None
    assert oversize_reason(b"x" * 11, limit=10) == \
        "the message body is 11 bytes, over max_message_bytes=10"
    assert oversize_reason(b"x" * 5, {"abc": "de"}, limit=9) == (
        "the message is 10 bytes (body 5, headers and key 5), over max_message_bytes=9")
    assert oversize_reason(b"", MANY, limit=DEFAULT_MAX_MESSAGE_BYTES) is None
    assert oversize_reason(b"", MANY, limit=100_000) is not None
    assert oversize_reason(DEEP, limit=DEFAULT_MAX_MESSAGE_BYTES) is None  # never parsed


def test_check_message_size_raises_a_malformed_message() -> None:
    check_message_size(b"x", limit=1)
    with pytest.raises(MessageTooLarge, match="over max_message_bytes=1") as caught:
        check_message_size(b"xx", limit=1)
    assert isinstance(caught.value, MalformedMessage)
    assert isinstance(caught.value, Reject)  # a Consumer dead-letters it


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
def test_a_bad_bound_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="max_message_bytes"):
        check_max_message_bytes(bad)
    assert check_max_message_bytes(None) is None
    assert check_max_message_bytes(1) == 1


# -- huge in other ways, on the real Redis --------------------------------------------------

redis = pytest.importorskip("redis")


@pytest.fixture
def topic(redis_url: str, unique: str) -> Iterator[str]:
    name = f"limits-{unique}"
    yield name
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{name}*"):
        client.delete(key)
    client.close()


def publish_hostile(redis_url: str, topic: str) -> None:
    foreign = redis.Redis.from_url(redis_url)
    foreign.xadd(topic, {"body": b"deep", "headers": DEEP})
    foreign.xadd(topic, {"body": b"many", "headers": json.dumps(MANY).encode()})
    foreign.xadd(topic, {"body": b"plain"})
    foreign.close()


def check_outcome(got: list[bytes], reasons: list[str]) -> None:
    assert got == [b"many", b"plain"]
    assert len(reasons) == 1 and "not UTF-8 JSON" in reasons[0]


@pytest.mark.redis
def test_deep_and_many_headers_end_well_sync(redis_url: str, topic: str) -> None:
    """Issue 25 (resource bounds): headers nested 100,000 deep are dead-lettered with a
    reason (the fetch failed with RecursionError before); 100,000 headers are
    delivered; the next entry is delivered."""
    from msgpatterns.brokers import RedisStreamsBroker

    with RedisStreamsBroker(redis_url) as broker:
        broker.subscribe(topic, "g")
        publish_hostile(redis_url, topic)
        got = broker.fetch([topic], "g", max_messages=10, timeout=1)
        assert len(got[0].headers) == 100_000
        for message in got:
            broker.ack(message)
        check_outcome([m.raw_body for m in got],
                      [d.reason for d in broker.list_dead_letters(topic, "g")])


@pytest.mark.redis
@pytest.mark.anyio
async def test_deep_and_many_headers_end_well_async(redis_url: str, topic: str) -> None:
    """Issue 25 (resource bounds): as the sync adapter, on AsyncRedisStreamsBroker."""
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker
    from msgpatterns.brokers import RedisStreamsBroker

    async with AsyncRedisStreamsBroker(redis_url) as broker:
        await broker.subscribe(topic, "g")
        publish_hostile(redis_url, topic)
        got = await broker.fetch([topic], "g", max_messages=10, timeout=1)
        for message in got:
            await broker.ack(message)
    with RedisStreamsBroker(redis_url) as sync:
        check_outcome([m.raw_body for m in got],
                      [d.reason for d in sync.list_dead_letters(topic, "g")])
