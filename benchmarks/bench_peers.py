"""msgpatterns vs FastStream vs Dramatiq vs the raw client loop, same servers, same run.

Every contender consumes the same number of pre-published messages with the same no-op
handler, on the same local Redis and RabbitMQ, one handler thread (or one asyncio
subscriber), the same prefetch (``PREFETCH``) and read batch (``BATCH``) where the
library has the setting. Each run publishes everything first (untimed, into its own
uniquely named stream or queue), then the clock runs from the start of consumption to
the last message handled; the run then stops its consumer and deletes its streams,
queues and keys. Runs alternate (A B C D A B C D ...) and each contender's median of
``--repeats`` runs is reported.

Cases (each plain, and with per-message idempotency on Redis: msgpatterns
``@idempotent(RedisChecker)`` in strict mode vs the peer's handler wrapped with AWS
Lambda Powertools ``idempotent_function`` on its Redis persistence layer, as in
bench_idempotency.py; the raw floor does ``SET NX PX`` + ``SET PX`` by hand):

* ``redis``: Consumer + RedisStreamsBroker; FastStream Redis Streams subscriber with a
  consumer group; Dramatiq's Redis broker (lists + Lua, not Streams: a different
  transport on the same server); raw redis-py XREADGROUP loop acking each batch with
  one XACK (the floor).
* ``rabbitmq-classic``: durable classic queues for everyone (msgpatterns with
  ``queue_type="classic"``; FastStream ``RabbitQueue`` classic; Dramatiq's
  RabbitmqBroker, whose queues are classic); raw pika ``basic_consume`` with prefetch
  100 and ``basic_ack(multiple=True)`` every 50 deliveries (the floor), and raw pika
  acking each delivery (a second row, not the floor).
* ``rabbitmq-quorum``: msgpatterns' default quorum queue, FastStream quorum, Dramatiq
  with a two-line subclass declaring quorum queues, raw pika on a quorum queue.

BENCH lines per case: msgpatterns / best peer (goal >= 2x) and msgpatterns / raw floor
(goal >= 0.9x on RabbitMQ, >= 0.7x on Redis, bench_brokers' goal).

    python benchmarks/bench_peers.py [--messages N | --quick] [--repeats R]
        [--cases redis,rabbitmq-classic,...] [--timeout S]

Needs the peers (dev extra): faststream[rabbit,redis], dramatiq[rabbitmq,redis],
aws-lambda-powertools.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from _bench import bench_line

from msgpatterns import Consumer, Message
from msgpatterns.idempotency import RedisChecker, idempotent
from msgpatterns.testing import services

BATCH = 256  # messages per read where the library takes it
PREFETCH = 1024  # unacked deliveries / max_in_flight, every contender
LEASE_MS = 30_000
TTL_MS = 86_400_000


@dataclass(frozen=True)
class Run:
    """One contender's run: how many messages, which case, a name unique to the run."""

    n: int
    idempotent: bool
    queue_type: str  # "classic" / "quorum" (RabbitMQ); "" for Redis
    timeout: float
    uid: str
    #: msgpatterns: the guarded function is called inside a plain handler (no batch
    #: claims: one claim and one completion per message), as bench_idempotency case 8.
    inside: bool = False

    @property
    def name(self) -> str:
        return f"bench-peers-{self.uid}"

    def bodies(self) -> list[bytes]:
        return [f"{self.uid}-{i}".encode() for i in range(self.n)]


class Counter:
    """Counts handled messages; ``wait`` returns when all ``n`` are in or raises.
    ``cpu``: the process's CPU seconds (every thread) from the first message handled
    to the last; ``Counter.last`` is the latest counter that saw all of its messages."""

    last: Counter | None = None

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.cpu_started = self.cpu = 0.0

    def hit(self) -> None:
        with self.lock:
            self.count += 1
            if self.count == 1:
                self.cpu_started = time.process_time()
            if self.count >= self.n:
                if not self.done.is_set():
                    self.cpu = time.process_time() - self.cpu_started
                    Counter.last = self
                self.done.set()

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError(f"only {self.count}/{self.n} messages in {timeout:.0f} s")


def redis_url() -> str:
    return services.url("redis")


def rabbitmq_url() -> str:
    return services.url("rabbitmq")


def delete_keys(client: Any, pattern: str) -> None:
    batch = list(client.scan_iter(match=pattern, count=10_000))
    for start in range(0, len(batch), 10_000):
        client.delete(*batch[start:start + 10_000])


# -- idempotency wrappers ---------------------------------------------------------------


def powertools_wrap(run: Run, inner: Callable[[], None]) -> Callable[[bytes], None]:
    """``inner`` guarded by Powertools' idempotent_function on its Redis layer, keyed by
    the message body; its records are named ``<run.name>:powertools#<hash>``, so the
    run's cleanup (``<run.name>*``) deletes them."""
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("POWERTOOLS_SERVICE_NAME", "bench")
    from aws_lambda_powertools.utilities.idempotency import (
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
        RedisCachePersistenceLayer,
    )

    client: Any = redis.Redis.from_url(redis_url())
    layer = RedisCachePersistenceLayer(client=client)
    config = IdempotencyConfig(event_key_jmespath="id", expires_after_seconds=86400)

    def process(record: dict[str, Any]) -> None:
        inner()

    decorate: Any = idempotent_function
    guarded: Callable[..., Any] = decorate(process, data_keyword_argument="record",
                                           persistence_store=layer, config=config,
                                           key_prefix=f"{run.name}:powertools")

    def call(body: bytes) -> None:
        guarded(record={"id": body.decode()})

    return call


def peer_handler(run: Run, counter: Counter) -> Callable[[bytes], None]:
    """What every peer's handler calls: a no-op (counted), Powertools-guarded or not."""
    if run.idempotent:
        return powertools_wrap(run, counter.hit)

    def call(body: bytes) -> None:
        counter.hit()

    return call


def raw_claim(client: Any, run: Run) -> Callable[[bytes], bool]:
    """The hand-written strict idempotency of the raw floors: claim, run, mark done."""
    token = uuid.uuid4().hex

    def claim_and_complete(body: bytes) -> bool:
        key = b"%s:raw:%s" % (run.name.encode(), body)
        if not client.set(key, token, nx=True, px=LEASE_MS):
            return False
        client.set(key, "D", px=TTL_MS)
        return True

    return claim_and_complete


def consume_with(consumer: Consumer, counter: Counter, timeout: float) -> float:
    start = time.perf_counter()
    consumer.start()
    try:
        counter.wait(timeout)
        return time.perf_counter() - start
    finally:
        consumer.stop(10)


async def wait_in_loop(counter: Counter, timeout: float) -> None:
    """Wait for ``counter`` without polling the event loop the handlers run on."""
    await asyncio.get_running_loop().run_in_executor(None, counter.wait, timeout)


def ours_handler(run: Run, counter: Counter, client: Any) -> Callable[[Message], None]:
    def handle(message: Message) -> None:
        counter.hit()

    if not run.idempotent:
        return handle
    checker = RedisChecker(client, namespace=run.name)
    if run.inside:
        def hit(body: bytes) -> None:
            counter.hit()

        once = idempotent(checker, key=lambda body: body, group="bench")(hit)

        def handle_inside(message: Message) -> None:
            once(message.raw_body)

        return handle_inside
    guarded: Callable[[Message], None] = idempotent(
        checker, key=lambda message: message.raw_body, group="bench")(handle)
    return guarded


# -- Redis ------------------------------------------------------------------------------


def publish_stream(client: Any, stream: str, bodies: list[bytes], field: str) -> None:
    for start in range(0, len(bodies), 2000):
        pipe = client.pipeline(transaction=False)
        for body in bodies[start:start + 2000]:
            pipe.xadd(stream, {field: body})
        pipe.execute()


def ours_redis(run: Run) -> float:
    from msgpatterns.brokers import RedisStreamsBroker

    client = redis.Redis.from_url(redis_url())
    try:
        publish_stream(client, run.name, run.bodies(), "body")
        counter = Counter(run.n)
        broker = RedisStreamsBroker(client)
        consumer = Consumer(broker, ours_handler(run, counter, client), topics=[run.name],
                            group="g", workers=1, max_in_flight=PREFETCH,
                            fetch_batch=BATCH, poll_timeout=0.05)
        try:
            elapsed = consume_with(consumer, counter, run.timeout)
        finally:
            broker.close()
        pending = client.xpending(run.name, "g")["pending"]
        if pending:
            raise RuntimeError(f"msgpatterns left {pending} entries unacked")
        return elapsed
    finally:
        delete_keys(client, f"{run.name}*")
        client.close()


def faststream_redis(run: Run) -> float:
    from faststream.redis import RedisBroker, StreamSub

    client = redis.Redis.from_url(redis_url())
    try:
        publish_stream(client, run.name, run.bodies(), "__data__")
        client.xgroup_create(run.name, "g", id="0")  # publish first, so read from 0
        counter = Counter(run.n)
        call = peer_handler(run, counter)

        async def main() -> float:
            broker = RedisBroker(redis_url(), logger=None)

            @broker.subscriber(stream=StreamSub(run.name, group="g", consumer="c",
                                                max_records=BATCH))
            async def handle(body: bytes) -> None:
                call(body)

            await broker.connect()
            try:
                start = time.perf_counter()
                await broker.start()
                await wait_in_loop(counter, run.timeout)
                return time.perf_counter() - start
            finally:
                await broker.stop()

        return asyncio.run(main())
    finally:
        delete_keys(client, f"{run.name}*")
        client.close()


def dramatiq_worker(broker: Any, run: Run, counter: Counter, queue: str,
                    publish: Callable[[Any], None]) -> float:
    """Declare the actor, publish every message (untimed), run one worker thread until
    all are handled."""
    import dramatiq

    call = peer_handler(run, counter)

    def handle(body: str) -> None:
        call(body.encode())

    actor = dramatiq.actor(handle, broker=broker, queue_name=queue,
                           actor_name=f"handle_{run.uid}")
    publish(actor)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.queue_prefetch = PREFETCH  # the default is 2 x worker_threads
    start = time.perf_counter()
    worker.start()
    try:
        counter.wait(run.timeout)
        return time.perf_counter() - start
    finally:
        worker.stop(timeout=10_000)
        broker.close()


def dramatiq_redis(run: Run) -> float:
    from dramatiq.brokers.redis import RedisBroker

    client = redis.Redis.from_url(redis_url())
    queue = f"q_{run.uid}"
    try:
        broker = RedisBroker(url=redis_url(), namespace=run.name)

        def publish(actor: Any) -> None:
            for body in run.bodies():
                actor.send(body.decode())

        return dramatiq_worker(broker, run, Counter(run.n), queue, publish)
    finally:
        delete_keys(client, f"{run.name}*")
        client.close()


def raw_redis(run: Run) -> float:
    client = redis.Redis.from_url(redis_url())
    try:
        publish_stream(client, run.name, run.bodies(), "body")
        client.xgroup_create(run.name, "g", id="0")
        claim = raw_claim(client, run) if run.idempotent else None
        seen = 0
        start = time.perf_counter()
        while seen < run.n:
            if time.perf_counter() - start > run.timeout:
                raise TimeoutError(f"only {seen}/{run.n} messages in {run.timeout:.0f} s")
            reply: Any = client.xreadgroup("g", "c", {run.name: ">"}, count=BATCH, block=100)
            for _, entries in reply or []:
                if claim is not None:
                    for _, fields in entries:
                        claim(fields[b"body"])
                client.xack(run.name, "g", *[entry_id for entry_id, _ in entries])
                seen += len(entries)
        return time.perf_counter() - start
    finally:
        delete_keys(client, f"{run.name}*")
        client.close()


# -- RabbitMQ ---------------------------------------------------------------------------


def pika_channel() -> tuple[Any, Any]:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url()))
    return conn, conn.channel()


def publish_queue(conn: Any, channel: Any, queue: str, bodies: list[bytes],
                  timeout: float) -> None:
    """Publish persistent messages to ``queue`` (default exchange) and wait until the
    server holds them all."""
    import pika

    props = pika.BasicProperties(delivery_mode=2)
    for body in bodies:
        channel.basic_publish("", queue, body, props)
    deadline = time.monotonic() + timeout
    while channel.queue_declare(queue, passive=True).method.message_count < len(bodies):
        if time.monotonic() > deadline:
            raise TimeoutError(f"queue {queue} not filled in {timeout:.0f} s")
        conn.sleep(0.05)


def queue_args(run: Run) -> dict[str, Any]:
    return {"x-queue-type": run.queue_type}


def ours_rabbitmq(run: Run) -> float:
    from msgpatterns.brokers import RabbitMQBroker

    topic, queue = run.name, f"{run.name}.g"
    conn, channel = pika_channel()
    client = redis.Redis.from_url(redis_url())
    try:
        channel.exchange_declare(topic, exchange_type="fanout", durable=True)
        channel.queue_declare(queue, durable=True, arguments=queue_args(run))
        channel.queue_bind(queue, topic, routing_key=topic)
        publish_queue(conn, channel, queue, run.bodies(), run.timeout)
        counter = Counter(run.n)
        broker = RabbitMQBroker(rabbitmq_url(), prefetch=PREFETCH, queue_type=run.queue_type)
        consumer = Consumer(broker, ours_handler(run, counter, client), topics=[topic],
                            group="g", workers=1, max_in_flight=PREFETCH,
                            fetch_batch=BATCH, poll_timeout=0.05)
        try:
            return consume_with(consumer, counter, run.timeout)
        finally:
            broker.close()
    finally:
        channel.queue_delete(queue)
        channel.exchange_delete(topic)
        conn.close()
        delete_keys(client, f"{run.name}*")
        client.close()


def faststream_rabbitmq(run: Run) -> float:
    from faststream.rabbit import Channel, QueueType, RabbitBroker, RabbitQueue

    conn, channel = pika_channel()
    client = redis.Redis.from_url(redis_url())
    queue = run.name
    try:
        channel.queue_declare(queue, durable=True, arguments=queue_args(run))
        publish_queue(conn, channel, queue, run.bodies(), run.timeout)
        counter = Counter(run.n)
        call = peer_handler(run, counter)

        async def main() -> float:
            broker = RabbitBroker(rabbitmq_url(), logger=None,
                                  default_channel=Channel(prefetch_count=PREFETCH))
            kind: Any = QueueType(run.queue_type)

            @broker.subscriber(RabbitQueue(queue, queue_type=kind, durable=True))
            async def handle(body: bytes) -> None:
                call(body)

            await broker.connect()
            try:
                start = time.perf_counter()
                await broker.start()
                await wait_in_loop(counter, run.timeout)
                return time.perf_counter() - start
            finally:
                await broker.stop()

        return asyncio.run(main())
    finally:
        channel.queue_delete(queue)
        conn.close()
        delete_keys(client, f"{run.name}*")
        client.close()


def dramatiq_rabbitmq(run: Run) -> float:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    class QuorumBroker(RabbitmqBroker):
        """Dramatiq declares classic queues; this declares its queues as quorum."""

        def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
            return {**super()._build_queue_arguments(queue_name), "x-queue-type": "quorum"}

    conn, channel = pika_channel()
    client = redis.Redis.from_url(redis_url())
    queue = f"q_{run.uid}"
    try:
        cls = QuorumBroker if run.queue_type == "quorum" else RabbitmqBroker
        broker = cls(url=rabbitmq_url())

        def publish(actor: Any) -> None:
            for body in run.bodies():
                actor.send(body.decode())
            deadline = time.monotonic() + run.timeout
            while channel.queue_declare(queue, passive=True).method.message_count < run.n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"queue {queue} not filled in {run.timeout:.0f} s")
                conn.sleep(0.05)

        return dramatiq_worker(broker, run, Counter(run.n), queue, publish)
    finally:
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            channel.queue_delete(name)
        conn.close()
        delete_keys(client, f"{run.name}*")
        client.close()


RAW_PIKA_PREFETCH = 100  # the batched-ack floor: prefetch 100, ...
RAW_PIKA_ACK_EVERY = 50  # ... basic_ack(multiple=True) every 50 deliveries


def raw_pika(run: Run) -> float:
    """The floor: prefetch 100, ``basic_ack(multiple=True)`` every 50 deliveries."""
    return raw_pika_loop(run, RAW_PIKA_ACK_EVERY, RAW_PIKA_PREFETCH)


def raw_pika_ack_each(run: Run) -> float:
    """The canonical loop: ``basic_ack`` per delivery, the contenders' prefetch."""
    return raw_pika_loop(run, 1, PREFETCH)


def raw_pika_loop(run: Run, ack_every: int, prefetch: int) -> float:
    conn, channel = pika_channel()
    client = redis.Redis.from_url(redis_url())
    queue = run.name
    try:
        channel.queue_declare(queue, durable=True, arguments=queue_args(run))
        publish_queue(conn, channel, queue, run.bodies(), run.timeout)
        claim = raw_claim(client, run) if run.idempotent else None
        seen = 0

        def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
            nonlocal seen
            if claim is not None:
                claim(body)
            seen += 1
            if seen % ack_every == 0 or seen == run.n:
                ch.basic_ack(method.delivery_tag, multiple=ack_every > 1)
            if seen == run.n:
                ch.stop_consuming()

        def too_late() -> None:
            channel.stop_consuming()

        channel.basic_qos(prefetch_count=prefetch)
        start = time.perf_counter()
        conn.call_later(run.timeout, too_late)
        channel.basic_consume(queue, on_message, auto_ack=False)
        channel.start_consuming()
        if seen < run.n:
            raise TimeoutError(f"only {seen}/{run.n} messages in {run.timeout:.0f} s")
        return time.perf_counter() - start
    finally:
        channel.queue_delete(queue)
        conn.close()
        delete_keys(client, f"{run.name}*")
        client.close()


# -- driver -----------------------------------------------------------------------------

OURS = "msgpatterns"
FLOOR = "raw"
RAW_EACH = "raw (ack each)"  # a second, slower raw row (RabbitMQ): not the floor
CASES: dict[str, tuple[str, str, list[tuple[str, Callable[[Run], float]]]]] = {
    # case: (service, queue type, [(contender, run)]), ours first, the floor last
    "redis": ("redis", "", [
        (OURS, ours_redis), ("faststream", faststream_redis),
        ("dramatiq-redis (lists, not Streams)", dramatiq_redis), (FLOOR, raw_redis)]),
    "rabbitmq-classic": ("rabbitmq", "classic", [
        (OURS, ours_rabbitmq), ("faststream", faststream_rabbitmq),
        ("dramatiq", dramatiq_rabbitmq), (RAW_EACH, raw_pika_ack_each), (FLOOR, raw_pika)]),
    "rabbitmq-quorum": ("rabbitmq", "quorum", [
        (OURS, ours_rabbitmq), ("faststream", faststream_rabbitmq),
        ("dramatiq (quorum subclass)", dramatiq_rabbitmq), (RAW_EACH, raw_pika_ack_each),
        (FLOOR, raw_pika)]),
}
FLOOR_GOAL = {"redis": 0.7, "rabbitmq": 0.9}
PEER_GOAL = 2.0


def run_case(case: str, idem: bool, n: int, repeats: int, timeout: float,
             ) -> dict[str, float | None]:
    """Messages/s (median of ``repeats`` alternating runs) per contender; None when a
    contender failed every run."""
    _, queue_type, contenders = CASES[case]
    times: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for _ in range(repeats):
        for name, fn in contenders:
            run = Run(n, idem, queue_type, timeout, uuid.uuid4().hex[:10])
            try:
                times[name].append(fn(run))
            except Exception as exc:  # reported, and the other contenders go on
                print(f"  {case}{' +idem' if idem else ''} {name}: run failed: "
                      f"{type(exc).__name__}: {exc}", flush=True)
    return {name: (n / statistics.median(ts) if ts else None) for name, ts in times.items()}


def report(case: str, idem: bool, rates: dict[str, float | None], n: int,
           repeats: int) -> list[str]:
    service = CASES[case][0]
    label = f"{case}{' + idempotency (Redis)' if idem else ''}"
    rows = [f"| {label} | " + " | ".join(
        f"{name} {rate:,.0f}" if rate else f"{name} failed" for name, rate in rates.items()) + " |"]
    ours = rates[OURS]
    peers = {name: rate for name, rate in rates.items()
             if name not in (OURS, FLOOR, RAW_EACH) and rate}
    print(f"{label}: " + ", ".join(
        f"{name} {rate:,.0f} msg/s" if rate else f"{name} failed"
        for name, rate in rates.items()), flush=True)
    if not ours:
        return rows
    extra = {"messages": n, "repeats": repeats, "idempotency": idem}
    if peers:
        best = max(peers, key=lambda name: peers[name])
        ratio = ours / peers[best]
        print(f"  msgpatterns / best peer ({best}) = {ratio:.2f} (goal >= {PEER_GOAL})")
        bench_line(f"peers.{case}", f"msgs_per_s_vs_best_peer{'_idempotent' if idem else ''}",
                   ours, peers[best], ratio, f">= {PEER_GOAL}", ratio >= PEER_GOAL,
                   best_peer=best, **extra)
    each = rates.get(RAW_EACH)
    if each:
        ratio = ours / each
        print(f"  msgpatterns / raw loop acking each delivery = {ratio:.2f}")
        bench_line(f"peers.{case}",
                   f"msgs_per_s_vs_raw_ack_each{'_idempotent' if idem else ''}",
                   ours, each, ratio, "info", True, **extra)
    floor = rates.get(FLOOR)
    if floor:
        goal = FLOOR_GOAL[service]
        ratio = ours / floor
        print(f"  msgpatterns / raw floor = {ratio:.2f} (goal >= {goal})")
        bench_line(f"peers.{case}", f"msgs_per_s_vs_raw{'_idempotent' if idem else ''}",
                   ours, floor, ratio, f">= {goal}", ratio >= goal, **extra)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="2,000 messages")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one run may take to publish or to consume")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated subset of {', '.join(CASES)}")
    args = parser.parse_args()
    n = 2_000 if args.quick else args.messages
    warnings.simplefilter("ignore")  # Powertools' "no Lambda context" and deprecations
    logging.getLogger("dramatiq").setLevel(logging.ERROR)
    print(f"{n:,} messages per run, medians of {args.repeats} alternating runs, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    table: list[str] = []
    for case in args.cases.split(","):
        service = CASES[case][0]
        reason = services._reachable(service)
        if reason is not None:
            print(f"{case}: skipped ({reason})")
            continue
        for idem in (False, True):
            rates = run_case(case, idem, n, args.repeats, args.timeout)
            table += report(case, idem, rates, n, args.repeats)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
