"""The ack window of AsyncRabbitMQBroker (acks of a loop turn batched into
``basic_ack(multiple=True)``, one writer per channel) against its plain twin
(``ack_window=False``: one ``basic_ack`` per delivery), on the real RabbitMQ.

Both run the same Hypothesis-generated schedules: per message a handler that succeeds,
fails once, asks for a retry once (``NeedRetry``), rejects, is slow, or outlives the
ack deadline once (``ack_timeout``: the delivery is retried; the late call writes
nothing); 1, 4 or 50 in flight; and graceful stops followed by a new consumer
part-way. Each run must end with the same effects and the same settlement per message
as the model and as the other run: handler calls, applied once or dead-lettered, and
nothing left on the queue.
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import time
import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_harness import delete_rabbitmq_topology
from msgpatterns import Message, NeedRetry, Reject
from msgpatterns.aio import AsyncConsumer
from msgpatterns.retry import Backoff, RetryPolicy

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(900)]

pytest.importorskip("aio_pika")

FATES = ("ok", "fail_once", "need_retry_once", "reject", "slow", "outlives_deadline")
ACK_TIMEOUT = 1.5
LATE = 3 * ACK_TIMEOUT  # how long the first call of "outlives_deadline" takes
POLICY = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.05), local_retries=0)


@dataclass(frozen=True)
class Schedule:
    fates: tuple[str, ...]
    in_flight: int
    stops: tuple[int, ...]  # after this many handler calls: stop gracefully, start anew


schedules = st.integers(4, 30).flatmap(lambda n: st.builds(
    Schedule,
    fates=st.lists(st.sampled_from(FATES), min_size=n, max_size=n).map(tuple),
    in_flight=st.sampled_from([1, 4, 50]),
    stops=st.lists(st.integers(1, n), max_size=2, unique=True).map(
        lambda xs: tuple(sorted(xs)))))


@dataclass
class Result:
    calls: dict[str, int]
    applied: dict[str, int]
    dead: list[str]
    left: int


def expected(schedule: Schedule) -> tuple[dict[str, int], dict[str, int], list[str]]:
    calls, applied, dead = {}, {}, []
    for i, fate in enumerate(schedule.fates):
        key = f"k{i}"
        calls[key] = 2 if fate in ("fail_once", "need_retry_once", "outlives_deadline") else 1
        if fate == "reject":
            dead.append(key)
        else:
            applied[key] = 1
    return calls, applied, sorted(dead)


def queue_messages(queue: str) -> int:
    out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name", "messages",
                          "--no-table-headers"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for line in out.splitlines():
        name, _, count = line.partition("\t")
        if name == queue:
            return int(count.strip())
    return 0


def settled_count(queue: str, within: float = 30.0) -> int:
    """Messages left in ``queue``: polled until 0 for up to ``within`` seconds (a
    quorum queue's counts reach ``rabbitmqctl`` a few seconds late)."""
    give_up = time.monotonic() + within
    while (left := queue_messages(queue)) and time.monotonic() < give_up:
        time.sleep(0.5)
    return left


def delete_queues(prefix: str) -> None:
    out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name", "--no-table-headers"],
                         capture_output=True, text=True, timeout=60, check=False).stdout
    for line in out.splitlines():
        if line.strip().startswith(prefix):
            subprocess.run(["rabbitmqctl", "-q", "delete_queue", line.strip()],
                           capture_output=True, timeout=60, check=False)


async def run(url: str, schedule: Schedule, *, ack_window: bool) -> Result:
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker
    from msgpatterns.brokers import RabbitMQBroker

    topic = f"adiff-{uuid.uuid4().hex[:10]}"
    fates = {f"k{i}": fate for i, fate in enumerate(schedule.fates)}
    calls: collections.Counter[str] = collections.Counter()
    applied: collections.Counter[str] = collections.Counter()
    progress = asyncio.Event()
    total = sum(expected(schedule)[0].values())

    async def handle(message: Message) -> None:
        key = str(message.key)
        calls[key] += 1
        progress.set()
        fate = fates[key]
        if fate == "slow":
            await asyncio.sleep(0.05)
        elif fate == "reject":
            raise Reject("schedule: reject")
        elif fate == "fail_once" and calls[key] == 1:
            raise RuntimeError("schedule: fail once")
        elif fate == "need_retry_once" and calls[key] == 1:
            raise NeedRetry(delay=0.05, reason="schedule: retry once")
        elif fate == "outlives_deadline" and calls[key] == 1:
            await asyncio.sleep(LATE)  # AckTimeout retries it meanwhile
            raise RuntimeError("schedule: too late")
        applied[key] += 1

    async def until(done: int) -> None:
        while sum(calls.values()) < done:
            progress.clear()
            await asyncio.wait_for(progress.wait(), 60)

    try:
        async with AsyncRabbitMQBroker(url, name=f"{topic}-pub") as publisher:
            await publisher.subscribe(topic, "g")
            for key in fates:
                await publisher.publish(topic, {"key": key}, key=key)
        broker = AsyncRabbitMQBroker(url, prefetch=schedule.in_flight, ack_window=ack_window)
        try:
            for stop_at in [*schedule.stops, None]:
                consumer = AsyncConsumer(broker, handle, topics=[topic], group="g",
                                         max_in_flight=schedule.in_flight, retry=POLICY,
                                         ack_timeout=ACK_TIMEOUT, poll_timeout=0.05)
                await consumer.start()
                try:
                    await until(total if stop_at is None else stop_at)
                    if stop_at is None:  # the last settlements are on their way
                        while consumer.in_flight:
                            await asyncio.sleep(0.01)
                finally:
                    await consumer.stop(30)
        finally:
            await broker.close()
        left = await asyncio.to_thread(settled_count, f"{topic}.g")
        with RabbitMQBroker(url) as admin:
            dead = sorted(str(d.message.key) for d in admin.list_dead_letters(topic, "g"))
        return Result(dict(calls), dict(applied), dead, left)
    finally:
        await asyncio.to_thread(delete_rabbitmq_topology, url, topic, "g")
        await asyncio.to_thread(delete_queues, topic)  # the retry queues


@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
def test_ack_window_and_one_ack_per_message_settle_alike(rabbitmq_url: str,
                                                         schedule: Schedule) -> None:
    url = rabbitmq_url
    window = asyncio.run(run(url, schedule, ack_window=True))
    plain = asyncio.run(run(url, schedule, ack_window=False))
    calls, applied, dead = expected(schedule)
    for result in (window, plain):
        assert result.calls == calls
        assert result.applied == applied
        assert result.dead == dead
        assert result.left == 0
    assert window == plain
