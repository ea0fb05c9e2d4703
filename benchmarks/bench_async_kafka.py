"""AsyncConsumer on Kafka: the aiokafka adapter vs the threaded confluent-kafka one.

Both consume the same number of pre-published messages from librdkafka's mock cluster
(in process, through its bootstrap address) with a no-op ``async def`` handler, 100 in
flight, fetch batches of 100; each run has its own topic and group, the clock runs from
the consumer's start to the last message handled (so each includes its group join:
aiokafka's classic protocol waits the mock's 3 s initial rebalance delay; the threaded
adapter uses the KIP-848 protocol, which joins at once - the join is reported
separately and taken out of the rate). Runs alternate; the best of the repeats counts.

    python benchmarks/bench_async_kafka.py [--messages N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from _bench import bench_line

from msgpatterns import Message
from msgpatterns.aio import AsyncConsumer
from msgpatterns.testing.kafka_mock import KafkaMockCluster

THREADED_CONSUMER = {"group.protocol": "consumer", "fetch.wait.max.ms": 50}
NATIVE_CONSUMER = {"fetch_max_wait_ms": 50}


def threaded(bootstrap: str) -> Any:
    from msgpatterns.aio.kafka import ThreadedAsyncKafkaBroker

    return ThreadedAsyncKafkaBroker(bootstrap, consumer_config=THREADED_CONSUMER)


def native(bootstrap: str) -> Any:
    from msgpatterns.aio.kafka_native import AIOKafkaBroker

    return AIOKafkaBroker(bootstrap, consumer_config=NATIVE_CONSUMER)


async def run(make: Callable[[str], Any], bootstrap: str, n: int) -> tuple[float, float]:
    """(seconds to consume ``n`` messages after the first arrived, seconds to the
    first message) for one adapter."""
    topic, group = f"bak-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    writer = make(bootstrap)
    await writer.publish_many(topic, [f"m{i}".encode() for i in range(n)])
    await writer.close()
    broker = make(bootstrap)
    seen = 0
    first = 0.0
    done = asyncio.Event()

    async def handler(message: Message) -> None:
        nonlocal seen, first
        seen += 1
        if seen == 1:
            first = time.perf_counter()
        if seen == n:
            done.set()

    consumer = AsyncConsumer(broker, handler, topics=[topic], group=group,
                             max_in_flight=100, fetch_batch=100, poll_timeout=0.05)
    start = time.perf_counter()
    async with consumer:
        await asyncio.wait_for(done.wait(), 600)
        end = time.perf_counter()
    await broker.close()
    return end - first, first - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.messages
    cluster = KafkaMockCluster()
    best: dict[str, float] = {"aiokafka": 0.0, "threaded": 0.0}
    joins: dict[str, float] = {"aiokafka": 0.0, "threaded": 0.0}
    for _ in range(args.repeats):  # alternate, so that machine noise hits both alike
        for name, make in (("aiokafka", native), ("threaded", threaded)):
            seconds, join = asyncio.run(run(make, cluster.bootstrap_servers, n))
            best[name] = max(best[name], (n - 1) / seconds)
            joins[name] = join
    ratio = best["aiokafka"] / best["threaded"]
    print(f"AsyncConsumer + AIOKafkaBroker (aiokafka):        {best['aiokafka']:10.0f} msg/s "
          f"(first message after {joins['aiokafka']:.1f} s)")
    print(f"AsyncConsumer + ThreadedAsyncKafkaBroker (threads): {best['threaded']:10.0f} msg/s "
          f"(first message after {joins['threaded']:.1f} s)")
    bench_line("async_kafka", "messages_per_second", best["aiokafka"], best["threaded"],
               ratio, goal=">= 1x the threaded adapter (to be the default)",
               met=ratio >= 1.0, messages=n, handler="no-op async", max_in_flight=100,
               fetch_batch=100, cluster="librdkafka mock, in process")
    cluster.close()


if __name__ == "__main__":
    main()
