"""AIOKafkaBroker (aiokafka) from the outside: librdkafka's mock cluster through its
bootstrap address, records written by a foreign client (kcat), committed offsets as the
cluster reports them, close() racing a fetch and acks, and a closed adapter."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker_harness import KAFKA_TEST_CONSUMER, kafka_cluster, require_library
from msgpatterns import Message
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import BrokerClosed, BrokerUnavailable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "regressions"))
from test_kafka import committed, end_offsets, kcat_produce

pytestmark = [pytest.mark.anyio, pytest.mark.kafka, pytest.mark.timeout(90)]

#: Short fetch waits and session timeouts: a classic group's hand-over on the mock
#: cluster waits about the session timeout.
NATIVE_CONSUMER = {"fetch_max_wait_ms": 50, "session_timeout_ms": 4000,
                   "heartbeat_interval_ms": 1000}


@pytest.fixture
def bootstrap() -> str:
    require_library("aiokafka", "AIOKafkaBroker")
    return str(kafka_cluster().bootstrap_servers)


@pytest.fixture
def topic() -> str:
    return f"knat-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def brokers() -> AsyncIterator[list[Any]]:
    made: list[Any] = []
    yield made
    for broker in made:
        with contextlib.suppress(Exception):
            await broker.close()


def make(bootstrap: str, made: list[Any]) -> Any:
    from msgpatterns.aio.kafka_native import AIOKafkaBroker

    broker = AIOKafkaBroker(bootstrap, consumer_config=NATIVE_CONSUMER)
    made.append(broker)
    return broker


async def drain(broker: Any, topic: str, group: str, count: int,
                within: float = 20.0) -> list[Message]:
    got: list[Message] = []
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within
    while len(got) < count and loop.time() < give_up:
        got.extend(await broker.fetch([topic], group, max_messages=count - len(got),
                                      timeout=0.2))
    return got


def _letter(message: Message) -> DeadLetter:
    return DeadLetter(message=message, error_type="E", error_message="x", traceback="",
                      attempts=1, first_failed_at=0.0, last_failed_at=0.0, reason="test")


async def test_kcat_records_commit_only_the_contiguous_acked_prefix(
        bootstrap: str, topic: str, brokers: list[Any]) -> None:
    """kcat writes six records to partition 0 (no msgpatterns headers). Each gets the
    id of its position; acking all but offset 2 commits offset 2 (never past it, as
    the cluster reports); a restarted consumer of the group starts again at offset 2;
    acking everything then commits the end of the log."""
    kcat_produce(bootstrap, topic, [f"k{i}:v{i}".encode() for i in range(6)],
                 "-K:", "-p", "0", "-H", "trace=abc")
    group = f"g-{topic}"
    broker = make(bootstrap, brokers)
    got = await drain(broker, topic, group, 6)
    assert [m.offset for m in got] == list(range(6))
    assert [m.id for m in got] == [f"{topic}-0-{i}" for i in range(6)]
    assert {m.headers["trace"] for m in got} == {"abc"}
    assert [m.key for m in got] == [f"k{i}" for i in range(6)]
    for m in reversed(got):
        if m.offset != 2:
            await broker.ack(m)
    assert (await broker.commit())[(group, topic, 0)] == 2
    assert committed(bootstrap, group, topic)[0] == 2
    await broker.close()

    again = make(bootstrap, brokers)
    redelivered = await drain(again, topic, group, 4)
    assert [m.offset for m in redelivered] == [2, 3, 4, 5]  # at least once, from 2
    for m in redelivered:
        await again.ack(m)
    await again.close()
    assert committed(bootstrap, group, topic)[0] == end_offsets(bootstrap, topic)[0] == 6


async def test_hostile_kcat_records_are_dead_lettered_where_the_sync_admin_sees_them(
        bootstrap: str, topic: str, brokers: list[Any]) -> None:
    """A null value, a header that is not UTF-8 and an attempt header "abc" cannot be
    handed out faithfully: each is dead-lettered with its reason (the same check as the
    sync adapter), listed by the sync KafkaBroker's admin; the good record proceeds."""
    from msgpatterns import headers as h
    from msgpatterns.brokers import KafkaBroker

    part = ["-p", "0"]
    kcat_produce(bootstrap, topic, [b"tomb:"], *part, "-Z", "-K:")
    kcat_produce(bootstrap, topic, [b"bad-utf8"], *part, "-H", os.fsdecode(b"blob=\xff"))
    kcat_produce(bootstrap, topic, [b"bad-attempt"], *part, "-H", f"{h.ATTEMPT}=abc")
    kcat_produce(bootstrap, topic, [b"good"], *part)
    group = f"g-{topic}"
    broker = make(bootstrap, brokers)
    [good] = await drain(broker, topic, group, 1)
    assert (good.raw_body, good.offset) == (b"good", 3)
    await broker.ack(good)
    await broker.close()
    assert committed(bootstrap, group, topic)[0] == 4
    with KafkaBroker(bootstrap, consumer_config=KAFKA_TEST_CONSUMER) as admin:
        dead = admin.list_dead_letters(topic, group)
    reasons = {d.message.offset: d.reason for d in dead}
    assert sorted(reasons) == [0, 1, 2], reasons
    assert "null" in reasons[0] and "blob" in reasons[1] and "abc" in reasons[2]


async def test_close_racing_a_fetch_and_acks_never_commits_past_an_unacked_record(
        bootstrap: str, topic: str, brokers: list[Any]) -> None:
    """close() while a fetch waits (30 s) and acks are being sent: the fetch ends with
    BrokerClosed at once, each ack either lands or raises BrokerClosed, the committed
    offsets never pass an unacked record, and a restarted consumer gets every
    unacked record again."""
    group = f"g-{topic}"
    writer = make(bootstrap, brokers)
    sent = [await writer.publish(topic, f"m{i}".encode(), key=str(i)) for i in range(12)]
    broker = make(bootstrap, brokers)
    got = await drain(broker, topic, group, 12)
    assert sorted(m.id for m in got) == sorted(sent)
    to_ack, held = got[::2], got[1::2]
    fetching = asyncio.Event()
    outcomes: list[Any] = []

    async def fetch_forever() -> None:
        fetching.set()
        try:
            while True:
                outcomes.extend(await broker.fetch([topic], group, 10, timeout=30))
        except BrokerClosed as exc:
            outcomes.append(exc)

    async def ack(message: Message, turns: int) -> bool:
        for _ in range(turns):
            await asyncio.sleep(0)
        try:
            await broker.ack(message)
            return True
        except BrokerClosed:
            return False

    fetcher = asyncio.create_task(fetch_forever())
    await fetching.wait()
    async def close_after(turns: int) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)
        await broker.close()

    results = await asyncio.gather(close_after(3), *(ack(m, i) for i, m in enumerate(to_ack)))
    await asyncio.wait_for(fetcher, 10)
    assert isinstance(outcomes[-1], BrokerClosed)
    assert not [m for m in outcomes if isinstance(m, Message)]  # nothing new was there
    acked = [m for m, ok in zip(to_ack, results[1:], strict=True) if ok]
    assert 0 < len(acked) < len(to_ack)  # the close landed between the acks
    unacked = [m for m in got if m not in acked]
    assert held[0] in unacked
    offsets = committed(bootstrap, group, topic)
    for m in unacked:
        assert offsets[m.partition] <= m.offset, (m.partition, m.offset, offsets)

    again = make(bootstrap, brokers)
    wanted, back = {m.id for m in unacked}, set()
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 20
    while not wanted <= back and loop.time() < give_up:  # acked ones may come too
        back.update(m.id for m in await again.fetch([topic], group, 12, timeout=0.2))
    assert wanted <= back


async def test_every_operation_after_close_raises_broker_closed(
        bootstrap: str, topic: str, brokers: list[Any]) -> None:
    """After close() (idempotent, also when called twice at once) every operation
    raises BrokerClosed, nothing reaches the topic, and the unacked record is not
    committed."""
    group = f"g-{topic}"
    broker = make(bootstrap, brokers)
    await broker.publish(topic, b"before")
    [message] = await drain(broker, topic, group, 1)
    await asyncio.gather(broker.close(), broker.close())
    await broker.close()
    operations = {
        "publish": lambda: broker.publish(topic, b"after"),
        "publish_many": lambda: broker.publish_many(topic, [b"after"]),
        "subscribe": lambda: broker.subscribe(topic, group),
        "fetch": lambda: broker.fetch([topic], group, 1, 5),
        "ack": lambda: broker.ack(message),
        "nack": lambda: broker.nack(message, 0.0),
        "dead_letter": lambda: broker.dead_letter(message, _letter(message)),
        "commit": broker.commit,
    }
    for name, operation in operations.items():
        with pytest.raises(BrokerClosed, match=name):
            await operation()
    assert sum(end_offsets(bootstrap, topic).values()) == 1  # "after" never produced
    assert committed(bootstrap, group, topic)[message.partition] < 1


async def test_unreachable_bootstrap_raises_broker_unavailable() -> None:
    """Nothing listens: the first operation fails with BrokerUnavailable (the aiokafka
    error as its cause), not a bare client exception."""
    require_library("aiokafka", "AIOKafkaBroker")
    from msgpatterns.aio.kafka_native import AIOKafkaBroker

    broker = AIOKafkaBroker("127.0.0.1:9", connect_timeout=1.0)
    with pytest.raises(BrokerUnavailable) as caught:
        await broker.publish("t", b"x")
    assert caught.value.__cause__ is not None
    await broker.close()


async def test_publish_many_returns_ids_in_order_readable_by_the_sync_adapter(
        bootstrap: str, topic: str, brokers: list[Any]) -> None:
    """publish_many's ids are the ids the sync KafkaBroker reads back (same wire)."""
    from broker_harness import drain as sync_drain
    from msgpatterns.brokers import KafkaBroker, Outgoing

    broker = make(bootstrap, brokers)
    ids = await broker.publish_many(topic, [b"a", Outgoing(b"b", key="kb",
                                                           headers={"n": "1"})])
    with KafkaBroker(bootstrap, consumer_config=KAFKA_TEST_CONSUMER) as sync:
        got = sync_drain(sync, topic, f"g-{topic}", count=2)
    by_id = {m.id: m for m in got}
    assert set(by_id) == set(ids)
    second = by_id[ids[1]]
    assert (second.raw_body, second.key, second.headers["n"]) == (b"b", "kb", "1")
