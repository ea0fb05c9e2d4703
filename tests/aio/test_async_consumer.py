"""AsyncConsumer on the async fake: what only the asyncio driver has - ``max_in_flight``
as its concurrency, handler tasks cancelled by a stop, ``async with``, signals under
``run()``, a fake shared with a sync consumer, a threaded sync broker, a health probe
from another thread while its loop is blocked. Every behaviour both drivers share is
in the parity suite (``tests/parity/``), one test body on both (DESIGN 12)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from msgpatterns import Backoff, InMemoryBroker, Message, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


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


async def test_health_from_another_thread_while_the_loop_is_blocked() -> None:
    """The snapshot is taken on the loop; a loop that does not answer within
    ``health_timeout`` (a handler blocking it) is reported not running."""
    broker = AsyncInMemoryBroker()
    entered = threading.Event()
    probes: list[bool] = []

    async def handler(message: Message) -> None:
        entered.set()
        time.sleep(1.0)  # blocks the event loop: the mistake a probe must see

    def probe() -> None:
        entered.wait(10)
        probes.append(consumer.health().running)

    consumer = AsyncConsumer(broker, handler, topics=["t"], group="g", poll_timeout=0.05)
    consumer.health_timeout = 0.2
    prober = threading.Thread(target=probe)
    prober.start()
    async with consumer:
        await broker.publish("t", b"x")
        while consumer.stats.acked < 1:
            await asyncio.sleep(0.01)
        prober.join(10)
        assert probes == [False]  # the blocked loop did not answer in time
        health = await asyncio.to_thread(consumer.health)  # answered on the loop
        assert health.running and health.ready and consumer.health().running
    assert not consumer.health().running and consumer.health().state == "stopped"
