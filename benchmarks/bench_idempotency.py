"""Idempotency checkers vs the raw clients and vs AWS Lambda Powertools, same servers,
same run. Every measurement alternates ours and the baseline over ``--repeats`` rounds
(after a warm-up round) and reports the median round of each (the machine is shared).

1. RedisChecker ``claim`` + ``complete`` per key vs raw redis-py ``SET NX PX`` + ``SET
   PX`` per key. Goal: ours >= 0.8x the raw keys/s.
2. ``claim_many`` + ``complete_many`` of 100 keys vs a raw pipeline of 100 ``SET NX PX``
   then a pipeline of 100 ``SET PX``. Goal: >= 0.7x.
3. SqlChecker on PostgreSQL: ``claim_many`` of 100 keys vs one raw ``executemany``
   INSERT of the same 100 rows (SQLAlchemy Core, one transaction); and the whole batch
   cycle, ``claim_many`` + ``complete_many`` vs ``executemany`` INSERT + UPDATE.
   Goal: >= 0.7x each.
4. ``@idempotent`` with a RedisChecker vs Powertools' ``idempotent_function`` with its
   Redis persistence layer, one new message per call. Goal: ours >= 3x faster per
   message, with strict completion (two round trips, like Powertools) and with
   write-behind (one round trip per message, completions written in batches). Beside
   each ratio: client CPU per message (this process, every thread) and Redis round
   trips per message (redis-py ``send_packed_command`` calls), each side.
5. ``@idempotent`` strict, as a Consumer handler (in-memory broker, the fetched batch's
   keys claimed in one round trip and completed in one, DONE before the acks) vs
   Powertools' ``idempotent_function`` called per message, same Redis. Goal: >= 5x
   faster per message.
6. The guard's own cost: ``@idempotent`` on a MemoryChecker per new message (no
   network: the six rules, keys and counters) vs the bare handler call. Reported, for
   comparing versions (run the script with each version's sources on the path).
7. Async ``@idempotent`` on an ``async def`` with AsyncRedisChecker (``redis.asyncio``,
   one message after another on the loop) vs the sync ``@idempotent`` with RedisChecker,
   per message, strict. Goal: >= 0.8x the sync rate.
8. ``@idempotent(RedisChecker)`` (strict) on a function called inside a Consumer
   handler - so no batch claims: one claim and one completion per message - on Redis
   Streams, vs FastStream's Redis Streams subscriber calling a function guarded by
   Powertools' ``idempotent_function`` (bench_peers.py's two contenders). Goal: >= 5x
   the messages per second. CPU per message (the process, from the first message
   handled to the last) and round trips per message beside (the sync redis-py
   client's: Powertools' on their side, the checker's and the broker's on ours; each
   side's publishing too, about 0.001 a message).

    python benchmarks/bench_idempotency.py [--keys N] [--repeats R]
        [--redis-url URL] [--postgres-url URL]
        [--only powertools|versions|async|per-call]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
import sqlalchemy as sa
from _bench import bench_line

from msgpatterns.idempotency import RedisChecker, SqlChecker, idempotent
from msgpatterns.testing import services

BATCH = 100
LEASE_MS = 30_000
TTL_MS = 86_400_000


def median_pair(repeats: int, ours: Callable[[], float], baseline: Callable[[], float],
                ) -> tuple[float, float]:
    """Median seconds of each over ``repeats`` rounds, measured alternately (and after a
    warm-up round each) so both see the same machine load."""
    ours()
    baseline()
    mine, base = [], []
    for _ in range(repeats):
        mine.append(ours())
        base.append(baseline())
    return statistics.median(mine), statistics.median(base)


def rate(count: int, elapsed: float) -> float:
    return count / elapsed


class Sampled:
    """A contender's round (returning wall seconds) that also keeps each round's CPU
    seconds (this process, every thread; or what ``cpu_of`` says the round's timed part
    took) and redis-py round trips."""

    def __init__(self, run: Callable[[], float],
                 cpu_of: Callable[[], float] | None = None) -> None:
        self.run = run
        self.cpu_of = cpu_of
        self.cpu: list[float] = []
        self.trips: list[int] = []

    def __call__(self) -> float:
        with round_trips() as trips:
            cpu = time.process_time()
            wall = self.run()
            cpu = time.process_time() - cpu
        self.cpu.append(cpu if self.cpu_of is None else self.cpu_of())
        self.trips.append(trips[0])
        return wall

    def per_message(self, n: int) -> dict[str, float]:
        """Median CPU microseconds and round trips per message (the warm-up left out)."""
        return {"cpu_us": round(statistics.median(self.cpu[1:]) / n * 1e6, 1),
                "round_trips": round(statistics.median(self.trips[1:]) / n, 3)}


@contextmanager
def round_trips() -> Iterator[list[int]]:
    """Count the sync redis-py client's round trips (``send_packed_command`` calls: one
    per command sent alone, one per pipeline) while the block runs, every thread; and
    the commands a checker's link writes to its connection's socket itself (with
    hiredis: ``_redispy._Line.exchange``, one round trip each)."""
    from redis.connection import AbstractConnection

    from msgpatterns import _redispy

    count = [0]
    lock = threading.Lock()
    send = AbstractConnection.send_packed_command
    line = getattr(_redispy, "_Line", None)  # None in older versions
    exchange = line.exchange if line is not None else None

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        with lock:
            count[0] += 1
        send(self, command, check_health)

    def exchanged(self: Any, packed: bytes) -> Any:
        with lock:
            count[0] += 1
        assert exchange is not None
        return exchange(self, packed)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    if line is not None:
        line.exchange = exchanged
    try:
        yield count
    finally:
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        if line is not None:
            line.exchange = exchange


class Keys:
    """Fresh keys for every round, so every claim is a first delivery."""

    def __init__(self) -> None:
        self.run = uuid.uuid4().hex[:8]
        self.round = 0

    def fresh(self, n: int) -> list[str]:
        self.round += 1
        return [f"bench-{self.run}-{self.round}-{i}" for i in range(n)]


def cleanup(client: redis.Redis, pattern: str) -> None:
    batch = list(client.scan_iter(match=pattern, count=10_000))
    for start in range(0, len(batch), 10_000):
        client.delete(*batch[start:start + 10_000])


# -- 1 and 2: RedisChecker vs raw redis-py ------------------------------------------------

def redis_single(url: str, n: int, repeats: int) -> None:
    client = redis.Redis.from_url(url)
    checker = RedisChecker(client, namespace="bench")
    keys = Keys()
    token = "P" + uuid.uuid4().hex

    def ours() -> float:
        batch = keys.fresh(n)
        start = time.perf_counter()
        for key in batch:
            checker.complete(checker.claim(key))
        return time.perf_counter() - start

    def raw() -> float:
        batch = [f"raw:{key}".encode() for key in keys.fresh(n)]
        start = time.perf_counter()
        for key in batch:
            client.set(key, token, nx=True, px=LEASE_MS)
            client.set(key, "D", px=TTL_MS)
        return time.perf_counter() - start

    mine, base = median_pair(repeats, ours, raw)
    ratio = base / mine
    bench_line("idempotency.redis", "claim+complete keys/s (1 key per call)",
               rate(n, mine), rate(n, base), ratio, ">= 0.8x raw SET NX + SET", ratio >= 0.8,
               keys=n)
    cleanup(client, "bench:*")
    cleanup(client, "raw:bench-*")


def redis_batch(url: str, n: int, repeats: int) -> None:
    client = redis.Redis.from_url(url)
    checker = RedisChecker(client, namespace="bench")
    keys = Keys()
    token = "P" + uuid.uuid4().hex
    batches = max(1, n // BATCH)

    def ours() -> float:
        rounds = [keys.fresh(BATCH) for _ in range(batches)]
        start = time.perf_counter()
        for batch in rounds:
            checker.complete_many(checker.claim_many(batch))
        return time.perf_counter() - start

    def raw() -> float:
        rounds = [[f"raw:{key}".encode() for key in keys.fresh(BATCH)] for _ in range(batches)]
        start = time.perf_counter()
        for batch in rounds:
            pipe = client.pipeline(transaction=False)
            for key in batch:
                pipe.set(key, token, nx=True, px=LEASE_MS)
            pipe.execute()
            pipe = client.pipeline(transaction=False)
            for key in batch:
                pipe.set(key, "D", px=TTL_MS)
            pipe.execute()
        return time.perf_counter() - start

    mine, base = median_pair(repeats, ours, raw)
    ratio = base / mine
    bench_line("idempotency.redis_batch", f"claim_many+complete_many keys/s (batches of {BATCH})",
               rate(batches * BATCH, mine), rate(batches * BATCH, base), ratio,
               ">= 0.7x raw pipelines", ratio >= 0.7, keys=batches * BATCH)
    cleanup(client, "bench:*")
    cleanup(client, "raw:bench-*")


# -- 3: SqlChecker vs raw executemany on PostgreSQL -------------------------------------------

def postgres_batch(url: str, n: int, repeats: int) -> None:
    engine = sa.create_engine(url)
    suffix = uuid.uuid4().hex[:8]
    checker = SqlChecker(url, f"bench_dedup_{suffix}")
    checker.create_table()
    plain = sa.Table(
        f"bench_plain_{suffix}", sa.MetaData(),
        sa.Column("dedup_key", sa.String(255), primary_key=True),
        sa.Column("state", sa.String(1), nullable=False),
        sa.Column("owner_token", sa.String(32), nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False, index=True),
    )
    plain.create(engine)
    keys = Keys()
    batches = max(1, n // BATCH)
    token = uuid.uuid4().hex

    def rows(batch: list[str]) -> list[dict[str, Any]]:
        expires = int(time.time() * 1000) + LEASE_MS
        return [{"dedup_key": key, "state": "P", "owner_token": token, "expires_at": expires}
                for key in batch]

    def ours_claim() -> float:
        rounds = [keys.fresh(BATCH) for _ in range(batches)]
        start = time.perf_counter()
        for batch in rounds:
            checker.claim_many(batch)
        return time.perf_counter() - start

    def raw_insert() -> float:
        rounds = [rows(keys.fresh(BATCH)) for _ in range(batches)]
        start = time.perf_counter()
        for batch in rounds:
            with engine.begin() as conn:
                conn.execute(plain.insert(), batch)
        return time.perf_counter() - start

    def ours_cycle() -> float:
        rounds = [keys.fresh(BATCH) for _ in range(batches)]
        start = time.perf_counter()
        for batch in rounds:
            checker.complete_many(checker.claim_many(batch))
        return time.perf_counter() - start

    def raw_cycle() -> float:
        rounds = [rows(keys.fresh(BATCH)) for _ in range(batches)]
        done = sa.update(plain).where(plain.c.dedup_key == sa.bindparam("k")).values(
            state="D", expires_at=sa.bindparam("e"))
        start = time.perf_counter()
        for batch in rounds:
            with engine.begin() as conn:
                conn.execute(plain.insert(), batch)
            expires = int(time.time() * 1000) + TTL_MS
            with engine.begin() as conn:
                conn.execute(done, [{"k": row["dedup_key"], "e": expires} for row in batch])
        return time.perf_counter() - start

    try:
        total = batches * BATCH
        mine, base = median_pair(repeats, ours_claim, raw_insert)
        ratio = base / mine
        bench_line("idempotency.postgres_batch", f"claim_many rows/s (batches of {BATCH})",
                   rate(total, mine), rate(total, base), ratio,
                   ">= 0.7x raw executemany INSERT", ratio >= 0.7, rows=total)
        mine, base = median_pair(repeats, ours_cycle, raw_cycle)
        ratio = base / mine
        bench_line("idempotency.postgres_cycle",
                   f"claim_many+complete_many rows/s (batches of {BATCH})",
                   rate(total, mine), rate(total, base), ratio,
                   ">= 0.7x raw executemany INSERT + UPDATE", ratio >= 0.7, rows=total)
    finally:
        checker.store.table.drop()
        checker.close()
        plain.drop(engine)
        engine.dispose()


# -- 4: @idempotent vs Powertools idempotent_function -------------------------------------------

def powertools_handler(url: str) -> Callable[..., Any]:
    """Powertools' idempotent_function on its Redis persistence layer."""
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("POWERTOOLS_SERVICE_NAME", "bench")
    warnings.simplefilter("ignore")  # deprecation and "no Lambda context" warnings
    from aws_lambda_powertools.utilities.idempotency import (
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
        RedisCachePersistenceLayer,
    )

    client: Any = redis.Redis.from_url(url)
    layer = RedisCachePersistenceLayer(client=client)
    config = IdempotencyConfig(event_key_jmespath="order_id", expires_after_seconds=86400)

    def process(record: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    decorate: Any = idempotent_function
    handler: Callable[..., Any] = decorate(process, data_keyword_argument="record",
                                           persistence_store=layer, config=config)
    return handler


def decorator_vs_powertools(url: str, n: int, repeats: int) -> None:
    client = redis.Redis.from_url(url)
    powertools = powertools_handler(url)
    keys = Keys()

    def ours_handler(checker: RedisChecker) -> Callable[..., Any]:
        @idempotent(checker, key=lambda record: record["order_id"])
        def process(record: dict[str, Any]) -> dict[str, Any]:
            return {"ok": True}

        return process

    def timing(call: Callable[[dict[str, Any]], Any], after: Callable[[], Any]) -> float:
        records = [{"order_id": key, "amount": 10} for key in keys.fresh(n)]
        start = time.perf_counter()
        for record in records:
            call(record)
        after()  # write-behind: every completion is written before the clock stops
        return time.perf_counter() - start

    for mode, write_behind in (("write-behind", 0.005), ("strict", None)):
        checker = RedisChecker(client, namespace="bench", write_behind=write_behind)
        handler = ours_handler(checker)

        def run_ours(handler: Callable[..., Any] = handler, checker: RedisChecker = checker,
                     ) -> float:
            return timing(handler, checker.flush)

        ours = Sampled(run_ours)
        theirs = Sampled(lambda: timing(lambda record: powertools(record=record),
                                        lambda: None))
        mine, base = median_pair(repeats, ours, theirs)
        speedup = base / mine
        mine_per, base_per = ours.per_message(n), theirs.per_message(n)
        bench_line("idempotency.decorator_vs_powertools",
                   f"us per new message, @idempotent ({mode}) vs idempotent_function",
                   mine / n * 1e6, base / n * 1e6, speedup, ">= 3x faster", speedup >= 3.0,
                   messages=n, completion=mode, cpu_us=mine_per["cpu_us"],
                   baseline_cpu_us=base_per["cpu_us"], round_trips=mine_per["round_trips"],
                   baseline_round_trips=base_per["round_trips"])
        checker.close()
    cleanup(client, "bench:*")
    cleanup(client, "*process#*")


def consumer_batch_vs_powertools(url: str, n: int, repeats: int) -> None:
    """Strict @idempotent through the Consumer (batch-aware claims) vs Powertools."""
    from msgpatterns import Consumer, InMemoryBroker, Message

    client = redis.Redis.from_url(url)
    powertools = powertools_handler(url)
    keys = Keys()
    checker = RedisChecker(client, namespace="bench")  # strict: no write-behind

    @idempotent(checker, group="bench.consumer")
    def handle(message: Message) -> None:
        pass

    def ours() -> float:
        broker = InMemoryBroker()
        for key in keys.fresh(n):
            broker.publish("orders", {"order_id": key}, id=key)
        consumer = Consumer(broker, handle, topics=["orders"], group="bench",
                            fetch_batch=BATCH, max_in_flight=4 * BATCH)
        start = time.perf_counter()
        stats = consumer.run_until_idle(timeout=600)
        elapsed = time.perf_counter() - start
        assert stats.acked == n, stats
        return elapsed

    def theirs() -> float:
        records = [{"order_id": key, "amount": 10} for key in keys.fresh(n)]
        start = time.perf_counter()
        for record in records:
            powertools(record=record)
        return time.perf_counter() - start

    mine, base = median_pair(repeats, ours, theirs)
    speedup = base / mine
    bench_line("idempotency.consumer_batch_vs_powertools",
               "us per new message, Consumer + @idempotent (strict, batch claims) vs "
               "idempotent_function per message", mine / n * 1e6, base / n * 1e6, speedup,
               ">= 5x faster", speedup >= 5.0, messages=n, batch=BATCH,
               completion="strict")
    checker.close()
    cleanup(client, "bench:*")
    cleanup(client, "*process#*")


def inside_handler_vs_faststream(n: int, repeats: int) -> None:
    """8: @idempotent called inside a Consumer handler vs FastStream + Powertools."""
    from bench_peers import Counter, Run, faststream_redis, ours_redis

    def consumed_cpu() -> float:  # from the first message handled to the last
        assert Counter.last is not None
        return Counter.last.cpu

    def contender(run: Callable[[Run], float], inside: bool) -> Sampled:
        return Sampled(lambda: run(Run(n, True, "", 600.0, uuid.uuid4().hex[:10],
                                       inside=inside)), consumed_cpu)

    ours, theirs = contender(ours_redis, True), contender(faststream_redis, False)
    mine, base = median_pair(repeats, ours, theirs)
    speedup = base / mine
    mine_per, base_per = ours.per_message(n), theirs.per_message(n)
    bench_line("idempotency.inside_handler_vs_faststream",
               "msgs/s, Consumer + a call of an @idempotent function (strict, no batch "
               "claims) vs FastStream + Powertools idempotent_function, Redis Streams",
               n / mine, n / base, speedup, ">= 5x", speedup >= 5.0, messages=n,
               cpu_us=mine_per["cpu_us"], baseline_cpu_us=base_per["cpu_us"],
               round_trips=mine_per["round_trips"],
               baseline_round_trips=base_per["round_trips"])


def guard_cost(n: int, repeats: int) -> None:
    """6: what the rules cost per message, without a network."""
    from msgpatterns.idempotency import MemoryChecker

    keys = Keys()

    def process(record: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    checker = MemoryChecker()
    guarded = idempotent(checker, key=lambda record: record["order_id"])(process)

    def timing(call: Callable[[dict[str, Any]], Any]) -> float:
        records = [{"order_id": key} for key in keys.fresh(n)]
        start = time.perf_counter()
        for record in records:
            call(record)
        return time.perf_counter() - start

    mine, base = median_pair(repeats, lambda: timing(guarded), lambda: timing(process))
    bench_line("idempotency.guard_cost", "us per new message, @idempotent(MemoryChecker) "
               "vs the bare handler", mine / n * 1e6, base / n * 1e6, base / mine,
               "reported", True, messages=n)


def async_vs_sync(url: str, n: int, repeats: int) -> None:
    """7: async @idempotent on AsyncRedisChecker vs the sync one on RedisChecker."""
    import asyncio

    client = redis.Redis.from_url(url)
    keys = Keys()
    # Both checkers built the same way, from the URL: the same timeouts, retries and
    # connection setup on either side (only the I/O model differs).
    sync_checker = RedisChecker(url, namespace="bench")
    loop = asyncio.new_event_loop()
    try:
        from msgpatterns.idempotency import AsyncRedisChecker

        async_checker: Any = AsyncRedisChecker(url, namespace="bench")
    except ImportError:
        async_checker = None

    @idempotent(sync_checker, key=lambda record: record["order_id"])
    def sync_process(record: dict[str, Any]) -> None:
        pass

    async def async_process(record: dict[str, Any]) -> None:
        pass

    if async_checker is not None:
        async_process = idempotent(async_checker, key=lambda record: record["order_id"])(
            async_process)

    def sync_round() -> float:
        records = [{"order_id": key} for key in keys.fresh(n)]
        start = time.perf_counter()
        for record in records:
            sync_process(record)
        return time.perf_counter() - start

    async def all_records(records: list[dict[str, Any]]) -> None:
        for record in records:
            await async_process(record)

    def async_round() -> float:
        records = [{"order_id": key} for key in keys.fresh(n)]
        start = time.perf_counter()
        loop.run_until_complete(all_records(records))
        return time.perf_counter() - start

    if async_checker is None:  # an older version on the path: the sync side only
        mine = base = statistics.median(sync_round() for _ in range(repeats + 1))
        bench_line("idempotency.async_vs_sync", "us per new message, sync @idempotent "
                   "(RedisChecker), strict (no async checker in this version)",
                   mine / n * 1e6, base / n * 1e6, 1.0, "reported", True, messages=n)
        sync_checker.close()
        return
    ours, theirs = Sampled(async_round), Sampled(sync_round)
    mine, base = median_pair(repeats, ours, theirs)
    ratio = base / mine
    bench_line("idempotency.async_vs_sync", "us per new message, async @idempotent "
               "(AsyncRedisChecker) vs sync @idempotent (RedisChecker), strict",
               mine / n * 1e6, base / n * 1e6, ratio, ">= 0.8x the sync rate", ratio >= 0.8,
               messages=n, cpu_us=ours.per_message(n)["cpu_us"],
               baseline_cpu_us=theirs.per_message(n)["cpu_us"],
               baseline_round_trips=theirs.per_message(n)["round_trips"])
    loop.run_until_complete(async_checker.aclose())
    loop.close()
    sync_checker.close()
    cleanup(client, "bench:*")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=5000, help="keys per round")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--redis-url", default=services.url("redis"))
    parser.add_argument("--postgres-url", default=services.url("postgres"))
    parser.add_argument("--only", choices=["powertools", "versions", "async", "per-call"],
                        default=None,
                        help="only the comparisons with Powertools (4, 5 and 8), only "
                        "the rows that compare versions (1, 2, 6, 7), only the async "
                        "one (7), or only the per-call rows of a guarded call (4 and 7)")
    args = parser.parse_args()
    if args.only == "per-call":
        decorator_vs_powertools(args.redis_url, args.keys, args.repeats)
        async_vs_sync(args.redis_url, args.keys, args.repeats)
        return
    if args.only == "async":
        async_vs_sync(args.redis_url, args.keys, args.repeats)
        return
    if args.only == "versions":
        redis_single(args.redis_url, args.keys, args.repeats)
        redis_batch(args.redis_url, args.keys * 4, args.repeats)
        guard_cost(args.keys * 4, args.repeats)
        async_vs_sync(args.redis_url, args.keys, args.repeats)
        return
    if args.only is None:
        redis_single(args.redis_url, args.keys, args.repeats)
        redis_batch(args.redis_url, args.keys * 4, args.repeats)
        postgres_batch(args.postgres_url, args.keys, args.repeats)
    decorator_vs_powertools(args.redis_url, args.keys, args.repeats)
    consumer_batch_vs_powertools(args.redis_url, args.keys, args.repeats)
    inside_handler_vs_faststream(args.keys, args.repeats)
    if args.only is None:
        guard_cost(args.keys * 4, args.repeats)
        async_vs_sync(args.redis_url, args.keys, args.repeats)


if __name__ == "__main__":
    main()
