"""Broker adapters: Consumer + adapter vs the bare client loop, same server, same run.

* Redis Streams: Consumer + RedisStreamsBroker vs raw redis-py XREADGROUP/XACK loops
  reading batches of 256 and running the same no-op handler per entry: one acking each
  batch with a single XACK (the fastest loop one can write with redis-py's client API)
  and the canonical one acking each message with its own XACK. The batch-handler
  Consumer is compared with the same fast loop calling the batch handler once per
  batch. Neither side decodes bodies (the Consumer has no decoder; the raw loop gets
  redis-py's parsed entries). Run with redis-py's Python reply parser and, when
  installed, hiredis. Goal: at least 0.7x the raw throughput with a per-message
  handler, 0.9x with a batch handler (``Consumer(..., batch=True)``).
* RabbitMQ (classic and quorum queues): Consumer + RabbitMQBroker vs raw pika
  ``basic_consume`` with prefetch 100 and ``basic_ack(multiple=True)`` every 50 (the
  floor a careful engineer writes), and vs the canonical loop acking each message.
  Client CPU per message (this process, all threads) is reported beside each ratio.
  Goal: at least 0.9x the batched-ack floor (issue 24).

Both sides consume the same number of pre-published messages with a no-op handler;
publishing is not timed.

* publish_many vs one-by-one publish, per adapter (Redis, RabbitMQ, NATS JetStream, Kafka
  on the librdkafka mock cluster), same broker object, same run: messages per second of
  ``publish`` in a loop and of ``publish_many`` in batches. Goal on RabbitMQ: at least
  10x (one confirm wait per batch instead of one per message). The asyncio adapters
  (``AsyncRabbitMQBroker``, ``AsyncNatsJetStreamBroker``) the same way on one event
  loop, with the client CPU per message of both sides beside the ratio.

Needs the real servers (MSGPATTERNS_REDIS_URL, MSGPATTERNS_RABBITMQ_URL,
MSGPATTERNS_NATS_URL); a missing one is reported and skipped.

    python benchmarks/bench_brokers.py [--messages N] [--repeats R]
    python benchmarks/bench_brokers.py --only publish_many [--publish-messages N]
    python benchmarks/bench_brokers.py --only rabbitmq   # the RabbitMQ consume row alone
    python benchmarks/bench_brokers.py --only redis [--parser hiredis]  # Redis rows alone
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from _bench import bench_line

from msgpatterns import Consumer, Message
from msgpatterns.testing import services

BATCH = 256  # messages per read, raw loop and Consumer alike
PREFETCH = 1024  # max_in_flight, and the RabbitMQ prefetch of both sides


class Counting:
    """The no-op handlers every side runs: count under a lock, signal the n-th."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def handler(self, message: Any) -> None:
        with self.lock:
            self.count += 1
            if self.count == self.n:
                self.done.set()

    def batch_handler(self, messages: list[Any]) -> None:
        with self.lock:
            self.count += len(messages)
            if self.count == self.n:
                self.done.set()


def consume_all(broker: Any, topic: str, group: str, n: int, batch: bool = False) -> float:
    """Seconds for a Consumer to process ``n`` messages with a no-op handler (a batch
    handler with ``batch``)."""
    counting = Counting(n)
    consumer = Consumer(broker, counting.batch_handler if batch else counting.handler,
                        topics=[topic], group=group, workers=1, max_in_flight=PREFETCH,
                        fetch_batch=BATCH, poll_timeout=0.05, batch=batch)
    start = time.perf_counter()
    consumer.start()
    if not counting.done.wait(300):
        raise RuntimeError(f"only {counting.count}/{n} messages consumed")
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


#: The raw loops: key -> (one XACK per message, a batch handler).
RAW_LOOPS = {"raw_batch_xack": (False, False), "raw_xack_each": (True, False),
             "raw_batch_xack_batch_handler": (False, True)}


def raw_loop(client: Any, stream: str, group: str, n: int, per_message: bool,
             batch: bool) -> float:
    """Seconds for the bare redis-py loop: XREADGROUP batches of BATCH, the same no-op
    handler per entry (or the batch handler once per batch), then one XACK per batch
    (or per message)."""
    counting = Counting(n)
    handler, batch_handler = counting.handler, counting.batch_handler
    client.xgroup_create(stream, group, id="0")
    start = time.perf_counter()
    while counting.count < n:
        reply: Any = client.xreadgroup(group, "c", {stream: ">"}, count=BATCH, block=100)
        for _, entries in reply or []:
            if batch:
                batch_handler(entries)
            else:
                for entry in entries:
                    handler(entry)
            ids = [entry_id for entry_id, _ in entries]
            if per_message:
                for entry_id in ids:
                    client.xack(stream, group, entry_id)
            else:
                client.xack(stream, group, *ids)
    return time.perf_counter() - start


def redis_round(url: str, n: int, parser: str = "python") -> dict[str, float]:
    """Seconds for: the Consumer (per-message and batch handler) and the raw loops."""
    from msgpatterns.brokers import RedisStreamsBroker

    client = redis_client(url, parser)
    stream = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            pipe.xadd(stream, {"body": str(i).encode()})
        pipe.execute()
        times: dict[str, float] = {}

        def timed_cpu(key: str, run: Callable[[], float]) -> None:
            """Wall seconds under ``key``, this process's CPU seconds (all threads;
            the Redis server's own work excluded) under ``key + "_cpu"``."""
            cpu = time.process_time()
            times[key] = run()
            times[key + "_cpu"] = time.process_time() - cpu

        for name, (per_message, batch) in RAW_LOOPS.items():
            timed_cpu(name, partial(raw_loop, client, stream, name, n, per_message, batch))
        broker = RedisStreamsBroker(client)
        timed_cpu("ours", partial(consume_all, broker, stream, "ours", n))
        timed_cpu("ours_batch", partial(consume_all, broker, stream, "ours_batch", n,
                                        batch=True))
        broker.close()
        for group in ("ours", "ours_batch"):
            assert client.xpending(stream, group)["pending"] == 0
        return times
    finally:
        for key in client.scan_iter(match=f"{stream}*"):
            client.delete(key)
        client.close()


# -- RabbitMQ -----------------------------------------------------------------------


#: The raw pika floors: prefetch 100 and ``basic_ack(multiple=True)`` every 50 (what a
#: careful engineer writes), and the canonical loop acking each message.
RAW_PIKA_PREFETCH = 100
RAW_PIKA_ACK_EVERY = 50


def raw_pika_loop(conn: Any, queue: str, n: int, ack_every: int, prefetch: int) -> float:
    """Seconds for a bare pika ``basic_consume`` loop over ``n`` deliveries of
    ``queue``: a manual ack every ``ack_every`` deliveries (``multiple=True`` when
    more than one), and the rest with the last."""
    channel = conn.channel()
    seen = 0

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        nonlocal seen
        seen += 1
        if seen % ack_every == 0 or seen == n:
            ch.basic_ack(method.delivery_tag, multiple=ack_every > 1)
        if seen == n:
            ch.stop_consuming()

    channel.basic_qos(prefetch_count=prefetch)
    start = time.perf_counter()
    channel.basic_consume(queue, on_message, auto_ack=False)
    channel.start_consuming()
    elapsed = time.perf_counter() - start
    channel.close()
    return elapsed


#: Raw RabbitMQ loops: key -> (ack every, prefetch).
RAW_PIKA = {"raw_batched_ack": (RAW_PIKA_ACK_EVERY, RAW_PIKA_PREFETCH),
            "raw_ack_each": (1, PREFETCH)}


def rabbitmq_round(url: str, n: int, queue_type: str = "quorum") -> dict[str, float]:
    """Seconds (and this process's CPU seconds, ``<key>_cpu``) for the Consumer and the
    raw pika loops, each on its own queue holding the same ``n`` messages."""
    import pika

    from msgpatterns.brokers import RabbitMQBroker

    topic = f"bench-{uuid.uuid4().hex[:8]}"
    our_group = "ours"
    our_queue = f"{topic}.{our_group}"
    queues = [f"{topic}.{key}" for key in RAW_PIKA] + [our_queue]
    conn = pika.BlockingConnection(pika.URLParameters(url))
    channel = conn.channel()
    try:
        channel.exchange_declare(topic, exchange_type="fanout", durable=True)
        for queue in queues:
            channel.queue_declare(queue, durable=True,
                                  arguments={"x-queue-type": queue_type})
            channel.queue_bind(queue, topic, routing_key=topic)
        for i in range(n):
            channel.basic_publish(topic, topic, str(i).encode(),
                                  pika.BasicProperties(delivery_mode=2))
        for queue in queues:  # wait until all are enqueued
            while channel.queue_declare(queue, passive=True).method.message_count < n:
                conn.sleep(0.05)
        times: dict[str, float] = {}

        def timed_cpu(key: str, run: Callable[[], float]) -> None:
            cpu = time.process_time()
            times[key] = run()
            times[key + "_cpu"] = time.process_time() - cpu

        for key, (every, prefetch) in RAW_PIKA.items():
            timed_cpu(key, partial(raw_pika_loop, conn, f"{topic}.{key}", n, every,
                                   prefetch))
        broker = RabbitMQBroker(url, prefetch=PREFETCH, queue_type=queue_type)
        try:
            timed_cpu("ours", partial(consume_all, broker, topic, our_group, n))
        finally:
            broker.close()
        left = channel.queue_declare(our_queue, passive=True).method.message_count
        assert left == 0, f"{left} messages left in {our_queue}"
        return times
    finally:
        for queue in queues:
            channel.queue_delete(queue)
        channel.exchange_delete(topic)
        conn.close()


RABBITMQ_BASELINES = {"ours": {
    "raw_batched_ack": f"raw pika, prefetch {RAW_PIKA_PREFETCH}, "
                       f"basic_ack(multiple=True) every {RAW_PIKA_ACK_EVERY}",
    "raw_ack_each": "raw pika, basic_ack per message"}}


# -- publish_many -------------------------------------------------------------------

PUBLISH_BATCH = 500  # messages per publish_many call


def _redis_publisher(url: str) -> tuple[Any, str, Callable[[], None]]:
    import redis

    from msgpatterns.brokers import RedisStreamsBroker

    client = redis.Redis.from_url(url)
    topic = f"bench-pm-{uuid.uuid4().hex[:8]}"

    def cleanup() -> None:
        client.delete(topic)
        client.close()
    return RedisStreamsBroker(client), topic, cleanup


def _rabbitmq_publisher(url: str) -> tuple[Any, str, Callable[[], None]]:
    import pika

    from msgpatterns.brokers import RabbitMQBroker

    broker = RabbitMQBroker(url)
    topic = f"bench-pm-{uuid.uuid4().hex[:8]}"
    broker.subscribe(topic, "g")  # a queue bound, so publishes are routable

    def cleanup() -> None:
        conn = pika.BlockingConnection(pika.URLParameters(url))
        channel = conn.channel()
        channel.queue_delete(f"{topic}.g")
        channel.exchange_delete(topic)
        conn.close()
    return broker, topic, cleanup


def _nats_publisher(url: str) -> tuple[Any, str, Callable[[], None]]:
    from msgpatterns.brokers import NatsJetStreamBroker

    broker = NatsJetStreamBroker(url)
    topic = f"bench-pm-{uuid.uuid4().hex[:8]}"

    def cleanup() -> None:
        reopened = NatsJetStreamBroker(url)
        try:
            reopened._run(reopened._js.delete_stream(reopened.stream_name(topic)))
        finally:
            reopened.close()
    return broker, topic, cleanup


_kafka_mock: Any = None


def _kafka_publisher(url: str) -> tuple[Any, str, Callable[[], None]]:
    from msgpatterns.brokers import KafkaBroker
    from msgpatterns.testing.kafka_mock import KafkaMockCluster

    global _kafka_mock
    if _kafka_mock is None:
        _kafka_mock = KafkaMockCluster()
    return (KafkaBroker(_kafka_mock.bootstrap_servers),
            f"bench-pm-{uuid.uuid4().hex[:8]}", lambda: None)


def publish_many_round(make: Callable[[str], tuple[Any, str, Callable[[], None]]],
                       url: str, n: int) -> dict[str, float]:
    """Seconds to send ``n`` messages one ``publish`` at a time and with
    ``publish_many`` in batches of PUBLISH_BATCH, on one broker object."""
    broker, topic, cleanup = make(url)
    try:
        broker.publish(topic, b"warm-up")
        start = time.perf_counter()
        for i in range(n):
            broker.publish(topic, str(i).encode())
        single = time.perf_counter() - start
        start = time.perf_counter()
        for first in range(0, n, PUBLISH_BATCH):
            ids = broker.publish_many(
                topic, [str(i).encode() for i in range(first, min(n, first + PUBLISH_BATCH))])
            assert len(ids) == min(PUBLISH_BATCH, n - first)
        many = time.perf_counter() - start
        return {"single": single, "many": many}
    finally:
        try:
            broker.close()
        finally:
            cleanup()


def compare_publish(name: str, service: str | None, make: Any, n: int, repeats: int,
                    goal: float) -> None:
    if service is not None and services._reachable(service) is not None:
        print(f"{name}: skipped ({services._reachable(service)})")
        return
    url = services.url(service) if service is not None else ""
    rounds = [publish_many_round(make, url, n) for _ in range(repeats)]
    single = n / min(r["single"] for r in rounds)
    many = n / min(r["many"] for r in rounds)
    ratio = many / single
    print(f"{name}: publish_many {many:,.0f} msg/s, one-by-one publish {single:,.0f} msg/s, "
          f"ratio {ratio:.1f}x (batches of {PUBLISH_BATCH}, best of {repeats})")
    bench_line(name, "publish_many_msgs_per_s_vs_publish", many, single, ratio,
               f">= {goal:g}", ratio >= goal, messages=n, batch=PUBLISH_BATCH,
               repeats=repeats)


async def _async_rabbitmq_publisher(url: str) -> tuple[Any, str, Callable[[], None]]:
    from msgpatterns.aio import AsyncRabbitMQBroker

    broker = AsyncRabbitMQBroker(url)
    topic = f"bench-apm-{uuid.uuid4().hex[:8]}"
    await broker.subscribe(topic, "g")  # a queue bound, so publishes are routable

    def cleanup() -> None:
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(url))
        channel = conn.channel()
        channel.queue_delete(f"{topic}.g")
        channel.exchange_delete(topic)
        conn.close()
    return broker, topic, cleanup


async def _async_nats_publisher(url: str) -> tuple[Any, str, Callable[[], None]]:
    from msgpatterns.aio import AsyncNatsJetStreamBroker
    from msgpatterns.brokers import NatsJetStreamBroker

    broker = AsyncNatsJetStreamBroker(url)
    topic = f"bench-apm-{uuid.uuid4().hex[:8]}"

    def cleanup() -> None:
        reopened = NatsJetStreamBroker(url)
        try:
            reopened._run(reopened._js.delete_stream(reopened.stream_name(topic)))
        finally:
            reopened.close()
    return broker, topic, cleanup


def publish_many_round_async(make: Any, url: str, n: int) -> dict[str, float]:
    """:func:`publish_many_round` for an asyncio adapter, on one event loop: seconds
    and client CPU seconds of each side."""
    async def run() -> dict[str, float]:
        broker, topic, cleanup = await make(url)
        try:
            await broker.publish(topic, b"warm-up")
            start, cpu = time.perf_counter(), time.process_time()
            for i in range(n):
                await broker.publish(topic, str(i).encode())
            single = time.perf_counter() - start
            single_cpu = time.process_time() - cpu
            start, cpu = time.perf_counter(), time.process_time()
            for first in range(0, n, PUBLISH_BATCH):
                ids = await broker.publish_many(
                    topic, [str(i).encode()
                            for i in range(first, min(n, first + PUBLISH_BATCH))])
                assert len(ids) == min(PUBLISH_BATCH, n - first)
            many = time.perf_counter() - start
            many_cpu = time.process_time() - cpu
            return {"single": single, "many": many, "single_cpu": single_cpu,
                    "many_cpu": many_cpu}
        finally:
            try:
                await broker.close()
            finally:
                cleanup()

    return asyncio.run(run())


def compare_publish_async(name: str, service: str, make: Any, n: int, repeats: int,
                          goal: float) -> None:
    if services._reachable(service) is not None:
        print(f"{name}: skipped ({services._reachable(service)})")
        return
    url = services.url(service)
    rounds = [publish_many_round_async(make, url, n) for _ in range(repeats)]
    best_single = min(rounds, key=lambda r: r["single"])
    best_many = min(rounds, key=lambda r: r["many"])
    single = n / best_single["single"]
    many = n / best_many["many"]
    ratio = many / single
    single_us = best_single["single_cpu"] / n * 1e6
    many_us = best_many["many_cpu"] / n * 1e6
    print(f"{name}: publish_many {many:,.0f} msg/s ({many_us:.0f} us CPU/msg), one-by-one "
          f"publish {single:,.0f} msg/s ({single_us:.0f} us CPU/msg), ratio {ratio:.1f}x "
          f"(batches of {PUBLISH_BATCH}, best of {repeats})")
    bench_line(name, "publish_many_msgs_per_s_vs_publish", many, single, ratio,
               f">= {goal:g}", ratio >= goal, messages=n, batch=PUBLISH_BATCH,
               repeats=repeats, cpu_us_per_msg=round(many_us, 1),
               baseline_cpu_us_per_msg=round(single_us, 1))


def publish_many_benches(n: int, repeats: int) -> None:
    compare_publish("brokers.redis_streams.publish_many", "redis", _redis_publisher, n,
                    repeats, 2)
    compare_publish("brokers.rabbitmq.publish_many", "rabbitmq", _rabbitmq_publisher, n,
                    repeats, 10)
    compare_publish("brokers.nats_jetstream.publish_many", "nats", _nats_publisher, n,
                    repeats, 2)
    compare_publish("brokers.kafka_mock.publish_many", None, _kafka_publisher, n,
                    repeats, 2)
    compare_publish_async("aio.rabbitmq.publish_many", "rabbitmq",
                          _async_rabbitmq_publisher, n, repeats, 10)
    compare_publish_async("aio.nats_jetstream.publish_many", "nats",
                          _async_nats_publisher, n, repeats, 2)


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

    def close(self) -> None:
        pass


def runtime_cost_us(n: int, repeats: int, batch: bool = False) -> float:
    """Microseconds per message the Consumer itself spends (message objects included)."""
    return min(consume_all(_NullBroker(n), "t", "g", n, batch=batch)
               for _ in range(repeats)) / n * 1e6


#: Our variants: the key in a round's timings -> (label, goal vs the raw loops).
OURS = {"ours": ("Consumer + adapter", 0.7),
        "ours_batch": ("Consumer (batch handler) + adapter", 0.9)}


def compare(name: str, service: str, run: Callable[..., dict[str, float]], n: int,
            repeats: int, baselines: dict[str, dict[str, str]], goal: float | None = None,
            **options: Any) -> None:
    """Run ``repeats`` rounds; for each of OURS present, the ratio of its best
    throughput to each of its ``baselines`` (key -> label)."""
    reason = services._reachable(service)
    if reason is not None:
        print(f"{name}: skipped ({reason})")
        return
    url = services.url(service)
    rounds = [run(url, n, **options) for _ in range(repeats)]
    best = {key: min(r[key] for r in rounds) for key in rounds[0]}
    for ours, (our_label, our_goal) in OURS.items():
        if ours not in best:
            continue
        goal_here = our_goal if goal is None else goal
        ours_rate = n / best[ours]
        suffix = "" if ours == "ours" else "_batch_handler"
        for key, label in baselines[ours].items():
            raw_rate = n / best[key]
            ratio = ours_rate / raw_rate
            print(f"{name}: {our_label} {ours_rate:,.0f} msg/s, {label} {raw_rate:,.0f} "
                  f"msg/s, ratio {ratio:.2f} (best of {repeats})")
            cpu: dict[str, float] = {}
            if f"{ours}_cpu" in best and f"{key}_cpu" in best:
                cpu = {"cpu_us_per_msg_ours": round(best[f"{ours}_cpu"] / n * 1e6, 2),
                       "cpu_us_per_msg_baseline": round(best[f"{key}_cpu"] / n * 1e6, 2)}
                print(f"{name}:   client CPU per message (least of {repeats}): "
                      f"{cpu['cpu_us_per_msg_ours']:.2f} us vs "
                      f"{cpu['cpu_us_per_msg_baseline']:.2f} us")
            metric = f"throughput_msgs_per_s{suffix}_vs_{key.removesuffix('_batch_handler')}"
            bench_line(name, metric, ours_rate, raw_rate, ratio, f">= {goal_here:g}",
                       ratio >= goal_here, messages=n, repeats=repeats, **options, **cpu)


REDIS_BASELINES = {
    "ours": {"raw_batch_xack": "raw loop, one XACK per batch",
             "raw_xack_each": "raw loop, one XACK per message"},
    "ours_batch": {"raw_batch_xack_batch_handler":
                   "raw loop (batch handler), one XACK per batch",
                   "raw_xack_each": "raw loop, one XACK per message"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--publish-messages", type=int, default=2_000)
    parser.add_argument("--only", choices=["consume", "publish_many", "rabbitmq", "redis"],
                        default=None)
    parser.add_argument("--parser", choices=["python", "hiredis"], default=None,
                        help="the Redis rows with this reply parser only (default: both)")
    parser.add_argument("--queue-types", default="classic,quorum",
                        help="RabbitMQ queue types to measure (comma-separated)")
    args = parser.parse_args()
    if args.only == "rabbitmq":  # the RabbitMQ consume row alone
        for queue_type in args.queue_types.split(","):
            compare(f"brokers.rabbitmq.{queue_type}", "rabbitmq", rabbitmq_round,
                    args.messages, args.repeats, RABBITMQ_BASELINES, goal=0.9,
                    queue_type=queue_type)
        return
    if args.only not in ("consume", "redis"):
        publish_many_benches(args.publish_messages, args.repeats)
    if args.only == "publish_many":
        return
    for batch in (False, True):
        cost = runtime_cost_us(args.messages, args.repeats, batch)
        print(f"runtime: the Consumer alone costs {cost:.2f} us/message"
              f"{' with a batch handler' if batch else ''} (a broker that does nothing)")
    parsers = ["python"]
    try:
        import hiredis  # noqa: F401

        parsers.append("hiredis")
    except ImportError:
        print("hiredis not installed: measuring redis-py's Python parser only")
    if args.parser is not None:
        parsers = [args.parser]
    for reply_parser in parsers:
        compare("brokers.redis_streams", "redis", redis_round, args.messages, args.repeats,
                REDIS_BASELINES, parser=reply_parser)
    if args.only == "redis":
        return
    for queue_type in args.queue_types.split(","):
        compare(f"brokers.rabbitmq.{queue_type}", "rabbitmq", rabbitmq_round, args.messages,
                args.repeats, RABBITMQ_BASELINES, goal=0.9, queue_type=queue_type)


if __name__ == "__main__":
    main()
