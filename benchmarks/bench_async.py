"""AsyncConsumer vs the sync Consumer on I/O-bound handlers, same broker, same run.

Both consume from the in-memory broker with a handler that waits 1 ms (the shape of a
handler calling a database or an HTTP service): the AsyncConsumer awaits
``asyncio.sleep(0.001)`` with 100 messages in flight, the sync Consumer calls
``time.sleep(0.001)`` on 8 worker threads. Throughput is messages per second of
``run_until_idle``; the runs alternate within each repeat and the best of the repeats
counts (the medians are printed too). Goal: the async consumer at least 5x the sync one.

The ceiling: bare asyncio doing the same 1 ms sleeps, 100 at a time, with no broker and
no consumer - 100 long-lived coroutines each looping ``await asyncio.sleep(0.001)``
(the best shape; ``gather`` waves of 100 are measured too, and the better counts). The
loop's timers are rounded up to whole milliseconds by ``epoll``, so even the ceiling is
well under 100 sleeps per ms; the consumer adds the broker's fetch and ack and its own
bookkeeping per message on one core. CPU microseconds per message (process time) are
printed for the consumer and the ceiling.

A second line compares the consumers with a strict ``@idempotent`` handler that does
nothing else, on the real Redis (``--redis-url``; skipped when Redis is not reachable):
AsyncConsumer with AsyncRedisChecker vs Consumer with RedisChecker, both claiming and
completing the keys of a batch in one round trip each. Goal: at least 0.8x the sync
consumer's rate.

A third line compares the NATS JetStream adapters under AsyncConsumer (no-op handler,
100 in flight, messages published beforehand to a topic of each run's own, on the real
server: ``--nats-url``; skipped when it is not reachable): the native
``AsyncNatsJetStreamBroker`` vs ``ThreadedAsyncBroker(NatsJetStreamBroker)`` (every
call a worker-thread hop onto the sync adapter's own I/O loop), with the client CPU per
message of each.

    python benchmarks/bench_async.py [--messages N] [--repeats R] [--redis-url URL]
    python benchmarks/bench_async.py --only nats [--nats-messages N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from _bench import bench_line, timed

from msgpatterns import Consumer, InMemoryBroker, Message
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker


async def wait_1ms(message: Message) -> None:
    await asyncio.sleep(0.001)


def block_1ms(message: Message) -> None:
    time.sleep(0.001)


def filled(n: int) -> InMemoryBroker:
    broker = InMemoryBroker(record_history=False)
    broker.publish_many("bench", range(n))
    broker.published.clear()
    return broker


def cpu_timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    cpu = time.process_time()
    elapsed = timed(fn)
    return elapsed, time.process_time() - cpu


def run_async(n: int) -> tuple[float, float]:
    """(seconds, CPU seconds) the AsyncConsumer takes for ``n`` messages (100 in
    flight)."""
    broker = AsyncInMemoryBroker(filled(n))
    consumer = AsyncConsumer(broker, wait_1ms, topics=["bench"], group="g",
                             max_in_flight=100)
    elapsed = cpu_timed(lambda: asyncio.run(consumer.run_until_idle(timeout=600)))
    assert len(broker.acked) == n and broker.pending == 0, consumer.stats
    return elapsed


def run_sync(n: int) -> float:
    """Seconds the sync Consumer takes for ``n`` messages (8 workers)."""
    broker = filled(n)
    consumer = Consumer(broker, block_1ms, topics=["bench"], group="g", workers=8,
                        max_in_flight=100)
    elapsed = timed(lambda: consumer.run_until_idle(timeout=600))
    assert len(broker.acked) == n and broker.pending == 0, consumer.stats
    return elapsed


def run_bare_asyncio(n: int) -> tuple[float, float]:
    """(seconds, CPU seconds) bare asyncio takes for ``n`` 1 ms sleeps, 100 at a time:
    100 long-lived coroutines each looping ``await asyncio.sleep(0.001)`` - the ceiling
    the event loop allows on this machine, with no broker and no consumer."""

    async def sleepers() -> None:
        left = n

        async def sleeper() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await asyncio.sleep(0.001)

        await asyncio.gather(*(sleeper() for _ in range(100)))

    return cpu_timed(lambda: asyncio.run(sleepers()))


def run_bare_waves(n: int) -> float:
    """Seconds for the same sleeps in ``gather`` waves of 100 (another shape)."""

    async def waves() -> None:
        for start in range(0, n, 100):
            await asyncio.gather(*(asyncio.sleep(0.001) for _ in range(min(100, n - start))))

    return timed(lambda: asyncio.run(waves()))


async def timed_async(work: Awaitable[object]) -> float:
    """Seconds ``await work`` takes."""
    start = time.perf_counter()
    await work
    return time.perf_counter() - start


def idempotent_runs(url: str, n: int) -> tuple[Callable[[], float], Callable[[], float],
                                                Callable[[], None]]:
    """(async run, sync run, cleanup): seconds each consumer takes for ``n`` new keys
    through a strict ``@idempotent`` no-op handler on Redis (batches of 100)."""
    import redis

    from msgpatterns.idempotency import AsyncRedisChecker, RedisChecker, idempotent

    namespace = f"bench-aio-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    sync_checker = RedisChecker(client, namespace)
    made = 0

    def fresh() -> InMemoryBroker:
        nonlocal made
        broker = InMemoryBroker(record_history=False)
        broker.publish_many("bench", [{"id": i} for i in range(made, made + n)])
        broker.published.clear()
        made += n
        return broker

    @idempotent(sync_checker, key=lambda m: m.body["id"], group="bench")
    def handle(message: Message) -> None:
        pass

    def sync_run() -> float:
        broker = fresh()
        consumer = Consumer(broker, handle, topics=["bench"], group="g", workers=8,
                            fetch_batch=100, max_in_flight=400)
        elapsed = timed(lambda: consumer.run_until_idle(timeout=600))
        assert len(broker.acked) == n, consumer.stats
        return elapsed

    async_checker = AsyncRedisChecker(url, namespace=namespace)  # serves loop after loop

    @idempotent(async_checker, key=lambda m: m.body["id"], group="bench")
    async def ahandle(message: Message) -> None:
        pass

    def async_run() -> float:
        broker = AsyncInMemoryBroker(fresh())
        consumer = AsyncConsumer(broker, ahandle, topics=["bench"], group="g",
                                 fetch_batch=100, max_in_flight=400)

        async def run() -> float:
            return await timed_async(consumer.run_until_idle(600))

        elapsed = asyncio.run(run())
        assert len(broker.acked) == n
        return elapsed

    def cleanup() -> None:
        asyncio.run(async_checker.aclose())
        keys = list(client.scan_iter(match=f"{namespace}:*", count=10_000))
        for start in range(0, len(keys), 10_000):
            client.delete(*keys[start:start + 10_000])
        sync_checker.close()

    return async_run, sync_run, cleanup


def idempotent_bench(url: str, n: int, repeats: int) -> None:
    """The BENCH line of the consumers with a strict @idempotent handler on Redis."""
    import redis

    try:
        redis.Redis.from_url(url).ping()
    except redis.RedisError as exc:
        print(f"# no Redis at {url} ({exc}): the @idempotent consumer line is skipped")
        return
    async_run, sync_run, cleanup = idempotent_runs(url, n)
    try:
        ours, base = [], []
        for _ in range(repeats):  # alternate
            ours.append(n / async_run())
            base.append(n / sync_run())
    finally:
        cleanup()
    mine, theirs = statistics.median(ours), statistics.median(base)
    print(f"AsyncConsumer + async @idempotent (AsyncRedisChecker): {mine:10.0f} msg/s")
    print(f"Consumer + @idempotent (RedisChecker), 8 workers:      {theirs:10.0f} msg/s")
    bench_line("async_consumer_idempotent", "messages_per_second", mine, theirs,
               mine / theirs, goal=">= 0.8x the sync Consumer", met=mine / theirs >= 0.8,
               messages=n, checker="AsyncRedisChecker vs RedisChecker, strict",
               fetch_batch=100, max_in_flight=400, workers=8, statistic="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000,
                        help="messages per async run (the sync run gets a fifth)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=os.environ.get(
        "MSGPATTERNS_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--keys", type=int, default=5000,
                        help="messages per @idempotent consumer run")
    parser.add_argument("--nats-url", default=os.environ.get(
        "MSGPATTERNS_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--nats-messages", type=int, default=5000,
                        help="messages per NATS consumer run")
    parser.add_argument("--only", choices=["nats"], default=None)
    args = parser.parse_args()
    if args.only == "nats":
        nats_bench(args.nats_url, args.nats_messages, args.repeats)
        return
    n_async, n_sync = args.messages, max(1, args.messages // 5)
    rates: dict[str, list[float]] = {"async": [], "sync": [], "ceiling": [], "waves": []}
    cpu: dict[str, list[float]] = {"async": [], "ceiling": []}
    for _ in range(args.repeats):  # alternate, so that machine noise hits all alike
        elapsed, used = run_async(n_async)
        rates["async"].append(n_async / elapsed)
        cpu["async"].append(used / n_async * 1e6)
        rates["sync"].append(n_sync / run_sync(n_sync))
        elapsed, used = run_bare_asyncio(n_async)
        rates["ceiling"].append(n_async / elapsed)
        cpu["ceiling"].append(used / n_async * 1e6)
        rates["waves"].append(n_async / run_bare_waves(n_async))
    best = {name: max(values) for name, values in rates.items()}
    median = {name: statistics.median(values) for name, values in rates.items()}
    ceiling = max(best["ceiling"], best["waves"])
    best_async, best_sync = best["async"], best["sync"]
    ratio = best_async / best_sync
    cpu_async, cpu_ceiling = min(cpu["async"]), min(cpu["ceiling"])
    print(f"AsyncConsumer, 100 in flight, 1 ms await: {best_async:10.0f} msg/s "
          f"(median {median['async']:.0f}; {cpu_async:.1f} CPU us/msg)")
    print(f"Consumer, 8 workers, 1 ms sleep:          {best_sync:10.0f} msg/s "
          f"(median {median['sync']:.0f})")
    print(f"bare asyncio, 100 sleepers x 1 ms:        {best['ceiling']:10.0f} /s "
          f"(median {median['ceiling']:.0f}; {cpu_ceiling:.1f} CPU us/sleep) - the ceiling")
    print(f"bare asyncio, gather waves of 100:        {best['waves']:10.0f} /s "
          f"(median {median['waves']:.0f})")
    print(f"ours / ceiling: {best_async / ceiling:.2f}; ceiling / sync: "
          f"{ceiling / best_sync:.2f}")
    bench_line("async_consumer", "messages_per_second", best_async, best_sync, ratio,
               goal=">= 5x the sync Consumer (8 workers)", met=ratio >= 5.0,
               messages=n_async, baseline_messages=n_sync, handler="1 ms wait",
               max_in_flight=100, workers=8, bare_asyncio_per_second=round(ceiling),
               of_ceiling=round(best_async / ceiling, 3),
               ceiling_ratio=round(ceiling / best_sync, 3),
               median_ratio=round(median["async"] / median["sync"], 3),
               cpu_us_per_message=round(cpu_async, 1),
               ceiling_cpu_us_per_sleep=round(cpu_ceiling, 1))
    idempotent_bench(args.redis_url, args.keys, args.repeats)
    nats_bench(args.nats_url, args.nats_messages, args.repeats)


def nats_run(url: str, n: int, native: bool) -> tuple[float, float]:
    """Seconds and CPU seconds for AsyncConsumer to consume ``n`` messages of a fresh
    topic through the native or the threaded NATS adapter."""
    from msgpatterns.aio import AsyncNatsJetStreamBroker, ThreadedAsyncBroker
    from msgpatterns.brokers import NatsJetStreamBroker

    topic = f"bench-anats-{uuid.uuid4().hex[:8]}"
    publisher = NatsJetStreamBroker(url)
    try:
        publisher.subscribe(topic, "g")
        for first in range(0, n, 500):
            publisher.publish_many(topic, [b"x"] * min(500, n - first))

        async def run() -> tuple[float, float]:
            done = asyncio.Event()
            count = 0

            async def handle(message: Message) -> None:
                nonlocal count
                count += 1
                if count == n:
                    done.set()

            broker: Any = (AsyncNatsJetStreamBroker(url) if native
                           else ThreadedAsyncBroker(NatsJetStreamBroker(url)))
            consumer = AsyncConsumer(broker, handle, topics=[topic], group="g",
                                     max_in_flight=100, fetch_batch=100, poll_timeout=0.05)
            start, cpu = time.perf_counter(), time.process_time()
            await consumer.start()
            await asyncio.wait_for(done.wait(), 600)
            await consumer.stop(30)
            elapsed, used = time.perf_counter() - start, time.process_time() - cpu
            await broker.close()
            return elapsed, used

        return asyncio.run(run())
    finally:
        publisher.run(publisher.jetstream.delete_stream(publisher.stream_name(topic)))
        publisher.close()


def nats_bench(url: str, n: int, repeats: int) -> None:
    from msgpatterns.testing import services

    try:
        services.require("nats")
    except BaseException as exc:  # a skip or a failure: report it and go on
        print(f"aio.nats: skipped ({exc})")
        return
    runs: dict[str, list[tuple[float, float]]] = {"native": [], "threaded": []}
    for _ in range(repeats):  # alternate, so that machine noise hits both alike
        runs["native"].append(nats_run(url, n, native=True))
        runs["threaded"].append(nats_run(url, n, native=False))
    best = {k: min(v) for k, v in runs.items()}
    rate = {k: n / best[k][0] for k in best}
    cpu = {k: min(used for _, used in v) / n * 1e6 for k, v in runs.items()}
    ratio = rate["native"] / rate["threaded"]
    print(f"AsyncConsumer on AsyncNatsJetStreamBroker: {rate['native']:8.0f} msg/s "
          f"({cpu['native']:.0f} CPU us/msg)")
    print(f"AsyncConsumer on ThreadedAsyncBroker(NatsJetStreamBroker): "
          f"{rate['threaded']:8.0f} msg/s ({cpu['threaded']:.0f} CPU us/msg); "
          f"native / threaded {ratio:.2f}x")
    bench_line("aio.nats_native_vs_threaded", "messages_per_second", rate["native"],
               rate["threaded"], ratio, goal=">= 1x the threaded face", met=ratio >= 1.0,
               messages=n, repeats=repeats, max_in_flight=100,
               cpu_us_per_msg=round(cpu["native"], 1),
               baseline_cpu_us_per_msg=round(cpu["threaded"], 1))


if __name__ == "__main__":
    main()
