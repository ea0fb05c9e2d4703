"""Broker adapters: Consumer + adapter vs the bare client loop, same server, same run.

* Redis Streams: Consumer + RedisStreamsBroker vs raw redis-py XREADGROUP/XACK loops
  reading batches of 256: one acking each batch with a single XACK (the fastest loop
  one can write) and the canonical one acking each message with its own XACK. Run with
  redis-py's Python reply parser and, when installed, hiredis. Goal: at least 0.7x the
  raw throughput.
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


def redis_client(url: str, parser: str) -> Any:
    """A client using redis-py's pure-Python RESP parser or hiredis."""
    import redis
    from redis import _parsers

    cls = _parsers._HiredisParser if parser == "hiredis" else _parsers._RESP3Parser
    return redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, parser_class=cls))


def redis_round(url: str, n: int, parser: str = "python") -> dict[str, float]:
    """Seconds for: the Consumer, a raw loop acking each batch with one XACK, and the
    canonical raw loop acking each message with its own XACK."""
    from msgpatterns.brokers import RedisStreamsBroker

    client = redis_client(url, parser)
    stream = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            pipe.xadd(stream, {"body": str(i).encode()})
        pipe.execute()
        times: dict[str, float] = {}
        for name, per_message in (("raw_batch_xack", False), ("raw_xack_each", True)):
            client.xgroup_create(stream, name, id="0")
            start = time.perf_counter()
            seen = 0
            while seen < n:
                reply: Any = client.xreadgroup(name, "c", {stream: ">"}, count=BATCH,
                                               block=100)
                for _, entries in reply or []:
                    ids = [entry_id for entry_id, _ in entries]
                    seen += len(ids)
                    if per_message:
                        for entry_id in ids:
                            client.xack(stream, name, entry_id)
                    else:
                        client.xack(stream, name, *ids)
            times[name] = time.perf_counter() - start

        broker = RedisStreamsBroker(client)
        times["ours"] = consume_all(broker, stream, "ours", n)
        assert client.xpending(stream, "ours")["pending"] == 0
        return times
    finally:
        for key in client.scan_iter(match=f"{stream}*"):
            client.delete(key)
        client.close()


# -- RabbitMQ -----------------------------------------------------------------------


def rabbitmq_round(url: str, n: int) -> dict[str, float]:
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
        return {"ours": ours, "raw": raw}
    finally:
        for queue in (raw_queue, our_queue):
            channel.queue_delete(queue)
        channel.exchange_delete(topic)
        conn.close()


# -- driver -------------------------------------------------------------------------


class _NullBroker:
    """Hands out ready-made messages and forgets acks: what the runtime alone costs."""

    def __init__(self, n: int) -> None:
        self.left = n

    def fetch(self, topics: Any, group: str, max_messages: int = 1,
              timeout: float = 0.0) -> list[Message]:
        count = min(self.left, max_messages)
        self.left -= count
        return [Message(b"", id=str(i), timestamp=0.0) for i in range(count)]

    def ack(self, message: Message) -> None:
        pass

    def nack(self, message: Message, delay: float = 0.0) -> None:
        pass

    def dead_letter(self, message: Message, record: Any) -> None:
        pass

    def publish(self, topic: str, body: Any, **kwargs: Any) -> str:
        return ""

    def now(self) -> float:
        return time.time()


def runtime_cost_us(n: int, repeats: int) -> float:
    """Microseconds per message the Consumer itself spends (message objects included)."""
    return min(consume_all(_NullBroker(n), "t", "g", n) for _ in range(repeats)) / n * 1e6


def compare(name: str, service: str, run: Callable[..., dict[str, float]], n: int,
            repeats: int, baselines: dict[str, str], **options: Any) -> None:
    reason = services._reachable(service)
    if reason is not None:
        print(f"{name}: skipped ({reason})")
        return
    url = services.url(service)
    rounds = [run(url, n, **options) for _ in range(repeats)]
    best = {key: min(r[key] for r in rounds) for key in rounds[0]}
    ours_rate = n / best["ours"]
    for key, label in baselines.items():
        raw_rate = n / best[key]
        ratio = ours_rate / raw_rate
        print(f"{name}: Consumer + adapter {ours_rate:,.0f} msg/s, {label} {raw_rate:,.0f} "
              f"msg/s, ratio {ratio:.2f} (best of {repeats})")
        bench_line(name, f"throughput_msgs_per_s_vs_{key}", ours_rate, raw_rate, ratio,
                   ">= 0.7", ratio >= 0.7, messages=n, repeats=repeats, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"runtime: the Consumer alone costs {runtime_cost_us(args.messages, args.repeats):.2f}"
          " us/message (a broker that does nothing)")
    parsers = ["python"]
    try:
        import hiredis  # noqa: F401

        parsers.append("hiredis")
    except ImportError:
        print("hiredis not installed: measuring redis-py's Python parser only")
    for reply_parser in parsers:
        compare("brokers.redis_streams", "redis", redis_round, args.messages, args.repeats,
                {"raw_batch_xack": "raw loop, one XACK per batch",
                 "raw_xack_each": "raw loop, one XACK per message"},
                parser=reply_parser)
    compare("brokers.rabbitmq", "rabbitmq", rabbitmq_round, args.messages, args.repeats,
            {"raw": "raw pika basic_consume, manual ack"})


if __name__ == "__main__":
    main()
