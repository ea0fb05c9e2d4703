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

    python benchmarks/bench_async.py [--messages N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000,
                        help="messages per async run (the sync run gets a fifth)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
