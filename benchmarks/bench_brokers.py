"""Broker adapters: Consumer + adapter vs the bare client loop, same server, same run.

* Redis Streams: Consumer + RedisStreamsBroker vs a raw redis-py XREADGROUP/XACK loop
  (batches of 64, one XACK per batch). Goal: at least 0.7x the raw throughput.
* RabbitMQ: Consumer + RabbitMQBroker vs raw pika ``basic_consume`` with a manual
  ``basic_ack`` per message, same prefetch. Goal: at least 0.7x.

Both sides consume the same number of pre-published messages with a no-op handler;
publishing is not timed. Needs the real servers (MSGPATTERNS_REDIS_URL,
MSGPATTERNS_RABBITMQ_URL); a missing one is reported and skipped.

    python benchmarks/bench_brokers.py [--messages N] [--repeats R]
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from _bench import bench_line

from msgpatterns import Consumer, Message
from msgpatterns.testing import services

BATCH = 256  # messages per read, raw loop and Consumer alike
PREFETCH = 1024  # max_in_flight, and the RabbitMQ prefetch of both sides


def consume_all(broker: Any, topic: str, group: str, n: int) -> float:
    """Seconds for a Consumer to process ``n`` messages with a no-op handler."""
    done = threading.Event()
    count = 0
    lock = threading.Lock()

    def handler(message: Message) -> None:
        nonlocal count
        with lock:
            count += 1
            if count == n:
                done.set()

    consumer = Consumer(broker, handler, topics=[topic], group=group, workers=1,
                        max_in_flight=PREFETCH, fetch_batch=BATCH, poll_timeout=0.05)
    start = time.perf_counter()
    consumer.start()
    if not done.wait(300):
        raise RuntimeError(f"only {count}/{n} messages consumed")
    while consumer.in_flight:  # the last acks are on their way
        time.sleep(0.001)
    elapsed = time.perf_counter() - start
    consumer.stop(10)
    return elapsed


# -- Redis Streams ------------------------------------------------------------------


def redis_round(url: str, n: int) -> tuple[float, float]:
    import redis

    from msgpatterns.brokers import RedisStreamsBroker

    client = redis.Redis.from_url(url)
    stream = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            pipe.xadd(stream, {"body": str(i).encode()})
        pipe.execute()

        client.xgroup_create(stream, "raw", id="0")
        start = time.perf_counter()
        seen = 0
        while seen < n:
            reply: Any = client.xreadgroup("raw", "c", {stream: ">"}, count=BATCH, block=100)
            for _, entries in reply or []:
                ids = [entry_id for entry_id, _ in entries]
                seen += len(ids)
                client.xack(stream, "raw", *ids)
        raw = time.perf_counter() - start

        broker = RedisStreamsBroker(client)
        ours = consume_all(broker, stream, "ours", n)
        assert client.xpending(stream, "ours")["pending"] == 0
        return ours, raw
    finally:
        for key in client.scan_iter(match=f"{stream}*"):
            client.delete(key)
        client.close()


# -- RabbitMQ -----------------------------------------------------------------------


def rabbitmq_round(url: str, n: int) -> tuple[float, float]:
    import pika

    from msgpatterns.brokers import RabbitMQBroker

    topic = f"bench-{uuid.uuid4().hex[:8]}"
    raw_queue, our_group = f"{topic}.raw", "ours"
    our_queue = f"{topic}.{our_group}"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    channel = conn.channel()
    try:
        channel.exchange_declare(topic, exchange_type="fanout", durable=True)
        for queue in (raw_queue, our_queue):
            channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
            channel.queue_bind(queue, topic, routing_key=topic)
        for i in range(n):
            channel.basic_publish(topic, topic, str(i).encode(),
                                  pika.BasicProperties(delivery_mode=2))
        for queue in (raw_queue, our_queue):  # wait until all are enqueued
            while channel.queue_declare(queue, passive=True).method.message_count < n:
                conn.sleep(0.05)

        seen = 0

        def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
            nonlocal seen
            ch.basic_ack(method.delivery_tag)
            seen += 1
            if seen == n:
                ch.stop_consuming()

        channel.basic_qos(prefetch_count=PREFETCH)
        start = time.perf_counter()
        channel.basic_consume(raw_queue, on_message, auto_ack=False)
        channel.start_consuming()
        raw = time.perf_counter() - start

        broker = RabbitMQBroker(url, prefetch=PREFETCH)
        try:
            ours = consume_all(broker, topic, our_group, n)
        finally:
            broker.close()
        return ours, raw
    finally:
        for queue in (raw_queue, our_queue):
            channel.queue_delete(queue)
        channel.exchange_delete(topic)
        conn.close()


# -- driver -------------------------------------------------------------------------


def runtime_ceiling(n: int, repeats: int) -> float:
    """Messages/s of the same Consumer over the in-memory fake: what any adapter can
    reach at best in this process."""
    from msgpatterns import InMemoryBroker

    def once() -> float:
        broker = InMemoryBroker(record_history=False)
        for i in range(n):
            broker.publish("t", str(i).encode())
        return consume_all(broker, "t", "g", n)

    return n / min(once() for _ in range(repeats))


def compare(name: str, service: str, run: Callable[[str, int], tuple[float, float]],
            n: int, repeats: int) -> None:
    reason = services._reachable(service)
    if reason is not None:
        print(f"{name}: skipped ({reason})")
        return
    url = services.url(service)
    rounds = [run(url, n) for _ in range(repeats)]
    ours = min(r[0] for r in rounds)
    raw = min(r[1] for r in rounds)
    ours_rate, raw_rate = n / ours, n / raw
    ratio = ours_rate / raw_rate
    ceiling = runtime_ceiling(n, repeats)
    print(f"{name}: Consumer + adapter {ours_rate:,.0f} msg/s, raw client loop "
          f"{raw_rate:,.0f} msg/s, ratio {ratio:.2f} (best of {repeats}); the Consumer "
          f"over the in-memory fake: {ceiling:,.0f} msg/s (at best "
          f"{ceiling / raw_rate:.2f}x the raw loop)")
    bench_line(name, "throughput_msgs_per_s", ours_rate, raw_rate, ratio, ">= 0.7",
               ratio >= 0.7, messages=n, repeats=repeats,
               runtime_ceiling_msgs_per_s=round(ceiling))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    compare("brokers.redis_streams", "redis", redis_round, args.messages, args.repeats)
    compare("brokers.rabbitmq", "rabbitmq", rabbitmq_round, args.messages, args.repeats)


if __name__ == "__main__":
    main()
