"""AsyncConsumer on the async fake: the Consumer's guarantees with ``async def``
handlers (DESIGN 2, 3, 7; issue 12 items 1 and 6)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from typing import Any

import pytest

from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, NeedRetry, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.errors import ConfigurationError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

SLOW_RETRY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(60), local_retries=0)


async def ok(message: Message) -> None:
    return None


# -- misuse refused loudly -------------------------------------------------------------


async def test_a_sync_handler_is_refused_naming_consumer() -> None:
    with pytest.raises(TypeError, match=r"msgpatterns\.Consumer"):
        AsyncConsumer(AsyncInMemoryBroker(), lambda m: None, topics=["t"], group="g")


async def test_a_sync_broker_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="AsyncBroker"):
        AsyncConsumer(InMemoryBroker(), ok, topics=["t"], group="g")  # type: ignore[arg-type]


async def test_the_sync_consumer_refuses_an_async_handler() -> None:
    with pytest.raises(TypeError, match="async def"):
        Consumer(InMemoryBroker(), ok, topics=["t"], group="g")


@pytest.mark.parametrize("option", [{"max_in_flight": 0}, {"poll_timeout": 0},
                                    {"group": ""}, {"topics": []}, {"ack_timeout": -1}])
async def test_bad_options_are_refused(option: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"topics": ["t"], "group": "g", **option}
    with pytest.raises(ConfigurationError):
        AsyncConsumer(AsyncInMemoryBroker(), ok, **kwargs)


# -- settle, retry, dead letter ------------------------------------------------------


async def test_acks_redelivers_and_dead_letters_on_virtual_time() -> None:
    broker = AsyncInMemoryBroker(seed=0)
    await broker.publish("t", b"fine")
    await broker.publish("t", b"flaky")
    await broker.publish("t", b"poison", key="bad")
    done: list[tuple[bytes, int]] = []

    async def handler(message: Message) -> None:
        await asyncio.sleep(0)
        if message.raw_body == b"poison" or (message.raw_body == b"flaky"
                                             and message.attempt < 2):
            raise ValueError(f"boom {message.attempt}")
        done.append((message.raw_body, message.attempt))

    consumer = AsyncConsumer(broker, handler, topics=["t"], group="g", retry=SLOW_RETRY)
    stats = await consumer.run_until_idle(timeout=10)  # 60 s backoffs: virtual jumps
    assert sorted(done) == [(b"fine", 1), (b"flaky", 2)]
    [record] = broker.dead_letters
    assert record.attempts == 3 and record.message.key == "bad"
    assert record.reason.startswith("gave up after 3 attempts: ValueError")
    assert (stats.acked, stats.redelivered, stats.dead_lettered) == (2, 3, 1)
    assert broker.pending == 0


async def test_need_retry_retries_locally_without_the_broker() -> None:
    broker = AsyncInMemoryBroker()
    await broker.publish("t", b"x")
    attempts: list[tuple[int, int]] = []

    async def handler(message: Message) -> None:
        attempts.append((message.attempt, message.local_retries))
        if message.local_retries < 2:
            raise NeedRetry()

    retry = RetryPolicy(local_retries=3, local_backoff=Backoff.fixed(0.001))
    stats = await AsyncConsumer(broker, handler, topics=["t"], group="g",
                                retry=retry).run_until_idle(timeout=10)
    assert attempts == [(1, 0), (1, 1), (1, 2)]
    assert (stats.retried_locally, stats.acked, broker.stats.nacks) == (2, 1, 0)


async def test_a_sync_decoder_error_dead_letters_and_the_consumer_goes_on() -> None:
    broker = AsyncInMemoryBroker()
    await broker.publish("t", b"{not json")
    await broker.publish("t", b'{"ok": 1}')
    bodies: list[Any] = []

    async def handler(message: Message) -> None:
        bodies.append(message.body)

    await AsyncConsumer(broker, handler, topics=["t"], group="g",
                        decoder=json.loads).run_until_idle(timeout=10)
    assert bodies == [{"ok": 1}]
    [record] = broker.dead_letters
    assert record.error_type.endswith("MalformedMessage") and record.attempts == 1


async def test_explicit_ack_from_another_thread_settles_once() -> None:
    broker = AsyncInMemoryBroker()
    await broker.publish("t", b"x")
    results: list[bool] = []
    threads: list[threading.Thread] = []

    def ack_twice(message: Message) -> None:
        results.append(message.ack())
        results.append(message.ack())  # settle once: the second is ignored

    async def handler(message: Message) -> None:
        message.disable_auto_ack()
        threads.append(threading.Thread(target=ack_twice, args=(message,)))
        threads[-1].start()

    stats = await AsyncConsumer(broker, handler, topics=["t"],
                                group="g").run_until_idle(timeout=10)
    threads[0].join()
    assert results == [True, False]
    assert (stats.acked, len(broker.acked), broker.pending) == (1, 1, 0)


async def test_a_message_never_acked_fails_at_its_ack_deadline() -> None:
    broker = AsyncInMemoryBroker()
    await broker.publish("t", b"x")
    seen: list[int] = []

    async def handler(message: Message) -> None:
        seen.append(message.attempt)
        if message.attempt == 1:
            message.disable_auto_ack()  # and never ack: the deadline fails it

    consumer = AsyncConsumer(broker, handler, topics=["t"], group="g", ack_timeout=0.05,
                             retry=SLOW_RETRY)
    stats = await consumer.run_until_idle(timeout=10)
    assert seen == [1, 2]
    assert (stats.ack_timeouts, stats.redelivered, stats.acked) == (1, 1, 1)
    assert broker.history[-2].kind == "deliver" and broker.pending == 0


async def test_max_in_flight_bounds_concurrent_handlers() -> None:
    broker = AsyncInMemoryBroker()
    for i in range(30):
        await broker.publish("t", str(i).encode())
    limit, running, peak = 4, 0, 0
    full = asyncio.Event()
    go = asyncio.Event()

    async def handler(message: Message) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == limit:
            full.set()
        await go.wait()
        running -= 1

    consumer = AsyncConsumer(broker, handler, topics=["t"], group="g", max_in_flight=limit)
    idle = asyncio.create_task(consumer.run_until_idle(timeout=10))
    await full.wait()
    go.set()
    stats = await idle
    assert peak == limit and stats.acked == 30


async def test_ordered_a_retrying_key_blocks_only_its_own_later_messages() -> None:
    broker = AsyncInMemoryBroker()
    for body, key in ((b"a1", "a"), (b"a2", "a"), (b"b1", "b"), (b"b2", "b")):
        await broker.publish("t", body, key=key)
    order: list[tuple[bytes, int]] = []

    async def handler(message: Message) -> None:
        order.append((message.raw_body, message.attempt))
        if message.raw_body == b"a1" and message.attempt == 1:
            raise ValueError("first try fails")

    await AsyncConsumer(broker, handler, topics=["t"], group="g", ordered=True,
                        retry=SLOW_RETRY).run_until_idle(timeout=10)
    assert order.index((b"a1", 2)) < order.index((b"a2", 1))  # a2 waited for a1
    assert order.index((b"b2", 1)) < order.index((b"a1", 2))  # b went on meanwhile
    assert broker.pending == 0


# -- stop ----------------------------------------------------------------------------


async def test_stop_hands_back_unfinished_work_and_no_handler_runs_after() -> None:
    broker = AsyncInMemoryBroker()
    for i in range(3):
        await broker.publish("t", str(i).encode())
    started = asyncio.Event()
    cancelled: list[bytes] = []
    after_stop = False

    async def handler(message: Message) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # never finishes on its own
        except asyncio.CancelledError:
            cancelled.append(message.raw_body)
            raise
        assert not after_stop

    consumer = AsyncConsumer(broker, handler, topics=["t"], group="g", poll_timeout=0.05)
    await consumer.start()
    await started.wait()
    assert await consumer.stop(0.01) is False
    after_stop = True
    assert sorted(cancelled) == [b"0", b"1", b"2"]
    assert consumer.stats.released == 3 and consumer.in_flight == 0
    assert broker.sync.in_flight("g") == 0  # all handed back, none held
    again = await broker.fetch(["t"], "g", max_messages=10)
    assert sorted(m.raw_body for m in again) == [b"0", b"1", b"2"]


async def test_stop_from_a_handler_requests_it_and_run_returns() -> None:
    broker = AsyncInMemoryBroker()
    await broker.publish("t", b"x")
    answers: list[bool] = []

    async def handler(message: Message) -> None:
        answers.append(await consumer.stop())

    consumer = AsyncConsumer(broker, handler, topics=["t"], group="g", poll_timeout=0.05)
    await consumer.run()
    assert answers == [False]
    assert consumer.stats.acked == 1


async def test_sigterm_stops_run_gracefully() -> None:
    broker = AsyncInMemoryBroker()
    await broker.publish("t", b"x")
    finished: list[bytes] = []

    async def handler(message: Message) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # run() handles it: graceful stop
        await asyncio.sleep(0)
        finished.append(message.raw_body)

    consumer = AsyncConsumer(broker, handler, topics=["t"], group="g", poll_timeout=0.05)
    await consumer.run()
    assert finished == [b"x"] and consumer.stats.acked == 1


async def test_async_with_starts_and_stops() -> None:
    broker = AsyncInMemoryBroker()
    done = asyncio.Event()

    async def handler(message: Message) -> None:
        done.set()

    async with AsyncConsumer(broker, handler, topics=["t"], group="g",
                             poll_timeout=0.05) as consumer:
        await broker.publish("t", b"x")
        await done.wait()
    assert consumer.in_flight == 0 and broker.pending == 0


async def test_sync_and_async_drivers_share_one_fake() -> None:
    fake = InMemoryBroker()
    broker = AsyncInMemoryBroker(fake)
    fake.publish("t", b"x")
    [first] = fake.fetch(["t"], "g")
    first.headers["x-note"] = "failed on the sync side"
    fake.nack(first, 30.0)  # a sync retry, due in 30 s (virtual)
    seen: list[tuple[int, str]] = []

    async def handler(message: Message) -> None:
        seen.append((message.attempt, message.headers["x-note"]))

    stats = await AsyncConsumer(broker, handler, topics=["t"], group="g").run_until_idle(10)
    assert stats.acked == 1 and seen == [(2, "failed on the sync side")]


async def test_a_threaded_sync_broker_serves_the_async_consumer() -> None:
    from msgpatterns.aio import ThreadedAsyncBroker

    fake = InMemoryBroker()
    for i in range(3):
        fake.publish("t", str(i).encode())
    seen: list[tuple[bytes, int]] = []

    async def handler(message: Message) -> None:
        seen.append((message.raw_body, message.attempt))
        if message.raw_body == b"1" and message.attempt == 1:
            raise ValueError("once")

    retry = RetryPolicy(backoff=Backoff.fixed(0), local_retries=0)
    stats = await AsyncConsumer(ThreadedAsyncBroker(fake), handler, topics=["t"], group="g",
                                retry=retry, poll_timeout=0.05).run_until_idle(10)
    assert sorted(seen) == [(b"0", 1), (b"1", 1), (b"1", 2), (b"2", 1)]
    assert stats.acked == 3 and fake.pending == 0
