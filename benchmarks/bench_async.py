"""AsyncConsumer vs the sync Consumer on I/O-bound handlers, same broker, same run.

Both consume from the in-memory broker with a handler that waits 1 ms (the shape of a
handler calling a database or an HTTP service): the AsyncConsumer awaits
``asyncio.sleep(0.001)`` with 100 messages in flight, the sync Consumer calls
``time.sleep(0.001)`` on 8 worker threads. Throughput is messages per second of
``run_until_idle``; the runs alternate within each repeat and the best of the repeats
counts. Goal: the async consumer at least 5x the sync one.

    python benchmarks/bench_async.py [--messages N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import time

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


def run_async(n: int) -> float:
    """Seconds the AsyncConsumer takes for ``n`` messages (100 in flight)."""
    broker = AsyncInMemoryBroker(filled(n))
    consumer = AsyncConsumer(broker, wait_1ms, topics=["bench"], group="g",
                             max_in_flight=100)
    elapsed = timed(lambda: asyncio.run(consumer.run_until_idle(timeout=600)))
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


def run_bare_asyncio(n: int) -> float:
    """Seconds bare asyncio takes for ``n`` 1 ms sleeps, 100 at a time: the ceiling
    the event loop allows on this machine, with no broker and no consumer."""

    async def waves() -> None:
        for start in range(0, n, 100):
            await asyncio.gather(*(asyncio.sleep(0.001) for _ in range(min(100, n - start))))

    return timed(lambda: asyncio.run(waves()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000,
                        help="messages per async run (the sync run gets a fifth)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n_async, n_sync = args.messages, max(1, args.messages // 5)
    best_async = best_sync = ceiling = 0.0
    for _ in range(args.repeats):  # alternate, so that machine noise hits all alike
        best_async = max(best_async, n_async / run_async(n_async))
        best_sync = max(best_sync, n_sync / run_sync(n_sync))
        ceiling = max(ceiling, n_async / run_bare_asyncio(n_async))
    ratio = best_async / best_sync
    print(f"AsyncConsumer, 100 in flight, 1 ms await: {best_async:10.0f} msg/s")
    print(f"Consumer, 8 workers, 1 ms sleep:          {best_sync:10.0f} msg/s")
    print(f"bare asyncio, 100 x 1 ms sleeps at a time: {ceiling:10.0f} /s (the ceiling)")
    bench_line("async_consumer", "messages_per_second", best_async, best_sync, ratio,
               goal=">= 5x the sync Consumer (8 workers)", met=ratio >= 5.0,
               messages=n_async, baseline_messages=n_sync, handler="1 ms wait",
               max_in_flight=100, workers=8, bare_asyncio_per_second=round(ceiling))


if __name__ == "__main__":
    main()
