"""Redis fast paths against their plain twins, on the same generated schedules.

A schedule is a workload (messages whose handler succeeds, is slow, fails once or
rejects), faults (``XREADGROUP`` replies lost on the wire through a TCP proxy, the
checker's connections killed) and a stop with a deadline followed by a new consumer.
Each schedule runs once per twin on the real Redis, and the two runs must agree:

* read-ahead on vs off (``RedisStreamsBroker(read_ahead=...)``);
* acks riding with the next read (``ack_flush_interval > 0``) vs one ``XACK`` per
  message (``ack_flush_interval=0``);
* ``AsyncRedisLink`` (the checker's own connections) vs redis-py's asyncio connection
  (the same checker on a client whose pool is not the plain one, so the link sends
  through ``client.execute_command``);
* the sync ``RedisLink`` (commands written to the socket of redis-py's connection,
  replies read by a hiredis reader) vs redis-py's own connection, the same way, under a
  ``Consumer``.

Agree means: the same final effects (which messages' handlers succeeded), the same
settlement per message (acked, or dead-lettered), and nothing pending afterwards. For
the broker twins, effects are compared as sets: a handler still running when its
consumer stopped may run again (at least once), on either twin. Behind ``@idempotent``
they are compared as counts per key (exactly once each) when no stop cuts the run.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis_fault_tools import (
    Driver,
    Effects,
    build_consumer,
    close_broker,
    drop_streams,
    kill_named,
    pending_of,
    redis_address,
    with_client_name,
)
from reliability_harness import examples

from msgpatterns import Consumer, InMemoryBroker, Reject, idempotent
from msgpatterns.aio.consumer import AsyncConsumer
from msgpatterns.aio.memory import AsyncInMemoryBroker
from msgpatterns.message import Message
from msgpatterns.retry import Backoff, RetryPolicy
from msgpatterns.testing import services
from redis_faults_proxy import LossyProxy

pytestmark = [pytest.mark.redis, pytest.mark.timeout(900)]

redis = pytest.importorskip("redis")

KINDS = ("ok", "ok", "ok", "slow", "fail_once", "reject")
POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0), local_retries=0)
#: ``InProgress`` (a duplicate meeting a live claim) is retried too: room for it
CHECKER_POLICY = RetryPolicy(max_attempts=50, backoff=Backoff.fixed(0.05), local_retries=0)


@dataclass(frozen=True)
class Schedule:
    kinds: tuple[str, ...]
    #: every n-th XREADGROUP reply (or checker connection kill) is lost; None: no fault
    fault_every: int | None
    #: stop the first consumer after this many handler runs (None: never)
    stop_after: int | None
    #: the stop's deadline (seconds)
    stop_timeout: float


schedules = st.builds(
    Schedule,
    kinds=st.lists(st.sampled_from(KINDS), min_size=4, max_size=40).map(tuple),
    fault_every=st.sampled_from([None, 2, 3, 5]),
    stop_after=st.none() | st.integers(1, 30),
    stop_timeout=st.sampled_from([0.0, 0.01, 1.0]),
)


def profile(weight: float) -> settings:
    return settings(max_examples=examples(weight), deadline=None, database=None,
                    print_blob=True, suppress_health_check=list(HealthCheck))


class Runs:
    """Counts handler runs (any outcome) and effects, and which bodies were rejected."""

    def __init__(self) -> None:
        self.effects = Effects()
        self.runs = 0
        self.rejected: set[str] = set()
        self.lock = threading.Lock()

    def handle(self, message: Message, kind: str) -> None:
        with self.lock:
            self.runs += 1
        body = message.raw_body.decode()
        if kind == "slow":
            time.sleep(0.005)
        elif kind == "fail_once" and message.attempt == 1:
            raise RuntimeError("first attempt fails")
        elif kind == "reject":
            with self.lock:
                self.rejected.add(body)
            raise Reject("rejected by the schedule")
        self.effects.applied(body)

    def settled(self, total: int) -> bool:
        with self.lock:
            return len(self.effects.count) + len(self.rejected) >= total


def run_broker_schedule(schedule: Schedule, **options: Any) -> dict[str, Any]:
    """One schedule on a sync Consumer and RedisStreamsBroker(``options``) through a
    lossy proxy: effects, dead letters, pending afterwards."""
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    url = services.require("redis")
    admin = redis.Redis.from_url(url)
    topic = f"diff-{uuid.uuid4().hex[:10]}"
    kinds = {f"m{i}:{kind}": kind for i, kind in enumerate(schedule.kinds)}
    for body in kinds:
        admin.xadd(topic, {"body": body})
    runs = Runs()
    host, port, db = redis_address()

    def handle(message: Message) -> None:
        runs.handle(message, kinds[message.raw_body.decode()])

    aheads = [0]

    def doom(data: bytes) -> bool:
        if b"XREADGROUP" not in data:
            return False
        if b"CLIENT" not in data:  # a read sent ahead (a fetch's read asks CLIENT ID)
            aheads[0] += 1
        return schedule.fault_every is not None
    with LossyProxy(host, port, doom=doom, every=schedule.fault_every or 1, most=3) as proxy:
        for part in range(2):
            early = part == 0 and schedule.stop_after is not None
            driver = Driver("sync")
            # small fetches: the reads fill their count, so reading ahead starts
            build, brokers = build_consumer(driver, proxy.url(db), topic, handle,
                                            policy=POLICY, fetch_batch=4, **options)
            driver.start(build)
            try:
                if early:
                    runs.effects.wait_for(lambda: runs.runs >= (schedule.stop_after or 0)
                                          or runs.settled(len(kinds)), 30)
                else:
                    runs.effects.wait_for(lambda: runs.settled(len(kinds)), 60)
                    runs.effects.wait_for(lambda: pending_of(admin, topic, "g") == 0
                                          and not admin.zcard(f"{topic}:delayed:g"), 20)
            finally:
                driver.call(lambda d=driver, t=schedule.stop_timeout if early else 10:
                            d.consumer.stop(t))
                close_broker(driver, brokers[0])
                driver.finish()
            if not early:
                break
        event(f"XREADGROUP replies lost: {min(proxy.lost, 1)}+")
        event(f"reads sent ahead: {min(aheads[0], 1)}+")
    pending = pending_of(admin, topic, "g")
    with RedisStreamsBroker(url) as reader:
        dead = {d.message.raw_body.decode() for d in reader.list_dead_letters(topic, "g")}
    drop_streams(admin, topic, "g")
    admin.close()
    return {"effects": set(runs.effects.count), "dead": dead, "pending": pending}


def expected(schedule: Schedule) -> dict[str, Any]:
    bodies = [f"m{i}:{kind}" for i, kind in enumerate(schedule.kinds)]
    return {"effects": {b for b in bodies if not b.endswith(":reject")},
            "dead": {b for b in bodies if b.endswith(":reject")}, "pending": 0}


@profile(0.08)
@given(schedule=schedules)
def test_read_ahead_on_and_off_agree(schedule: Schedule) -> None:
    on = run_broker_schedule(schedule, read_ahead=True)
    off = run_broker_schedule(schedule, read_ahead=False)
    assert on == off == expected(schedule)


@profile(0.08)
@given(schedule=schedules)
def test_acks_riding_with_reads_and_separate_xacks_agree(schedule: Schedule) -> None:
    riding = run_broker_schedule(schedule, ack_flush_interval=0.05)
    separate = run_broker_schedule(schedule, ack_flush_interval=0)
    assert riding == separate == expected(schedule)


# -- AsyncRedisLink vs redis-py's own asyncio connection ------------------------------------


class PlainPool(redis.asyncio.ConnectionPool):  # type: ignore[misc]
    """Not redis-py's plain pool: the link then talks through
    ``client.execute_command`` (redis-py's own connection handling)."""


def run_checker_schedule(schedule: Schedule, *, link: bool) -> dict[str, Any]:
    """One schedule (each message published twice: a duplicate) on an AsyncConsumer
    with ``@idempotent(AsyncRedisChecker)`` over the link or redis-py's connection;
    every ``fault_every``-th handler run kills the checker's connections first."""
    from msgpatterns.idempotency import AsyncRedisChecker

    unique = uuid.uuid4().hex[:10]
    name = f"diff-checker-{unique}"
    url = with_client_name(services.require("redis"), name)
    admin = redis.Redis.from_url(services.require("redis"))
    sync_broker = InMemoryBroker()
    topic = "orders"
    kinds = {f"k{i}": kind for i, kind in enumerate(schedule.kinds)}
    label: dict[str | None, str] = {}  # message id -> key#copy (ids differ per run)
    for copy in (1, 2):  # each key twice: the second is a duplicate
        for key in kinds:
            label[sync_broker.publish(topic, key.encode(), key=key)] = f"{key}#{copy}"
    effects: collections.Counter[str] = collections.Counter()
    runs = [0]
    done = threading.Event()
    total = 2 * len(kinds)

    async def main() -> None:
        client = (redis.asyncio.Redis.from_url(url) if link else
                  redis.asyncio.Redis(connection_pool=PlainPool.from_url(url)))
        # a short lease: a claim a stop left behind frees within a second
        checker = AsyncRedisChecker(client, namespace=f"diff-{unique}", ttl=600, lease=1)

        @idempotent(checker, group="g")
        async def handle(message: Message) -> None:
            key = str(message.key)
            runs[0] += 1
            if schedule.fault_every and runs[0] % schedule.fault_every == 0:
                await asyncio.to_thread(kill_named, admin, name)
            kind = kinds[key]
            if kind == "slow":
                await asyncio.sleep(0.005)
            elif kind == "fail_once" and message.attempt == 1:
                raise RuntimeError("first attempt fails")
            elif kind == "reject":
                raise Reject("rejected by the schedule")
            effects[key] += 1

        def settled() -> bool:
            return len(sync_broker.acked) + len(sync_broker.dead_letters) >= total

        for part in range(2):
            consumer = AsyncConsumer(AsyncInMemoryBroker(sync_broker), handle, topics=[topic],
                                     group="g", max_in_flight=8, retry=CHECKER_POLICY,
                                     poll_timeout=0.02)
            await consumer.start()
            give_up = time.monotonic() + 60
            while not settled() and time.monotonic() < give_up:
                if part == 0 and schedule.stop_after is not None \
                        and runs[0] >= schedule.stop_after:
                    break
                await asyncio.sleep(0.01)  # polling the fake's counters
            await consumer.stop(schedule.stop_timeout if part == 0 else 5)
            if settled():
                break
        event(f"checker connection kills: {min(runs[0] // (schedule.fault_every or 10**9), 1)}+")
        await checker.aclose()
        await client.aclose()
        done.set()

    asyncio.run(main())
    admin.close()
    assert done.is_set()
    return {"effects": dict(effects),
            "acked": {label[m.id] for m in sync_broker.acked},
            "dead": {label[d.message.id] for d in sync_broker.dead_letters},
            "pending": sync_broker.pending}


@profile(0.08)
@given(schedule=schedules)
def test_async_redis_link_and_redis_py_connection_agree(schedule: Schedule) -> None:
    ours = run_checker_schedule(schedule, link=True)
    theirs = run_checker_schedule(schedule, link=False)
    applied = {f"k{i}" for i, kind in enumerate(schedule.kinds) if kind != "reject"}
    for run in (ours, theirs):
        assert set(run["effects"]) == applied
        assert run["pending"] == 0
    assert ours["acked"] == theirs["acked"]
    assert ours["dead"] == theirs["dead"]
    if schedule.stop_after is None:
        # exactly once on both. With a stop whose deadline cuts a claim round short the
        # runtime may still release claims of handlers that returned (issue 19, hole 1:
        # another branch); until that lands, stops are compared by the sets above.
        assert ours["effects"] == theirs["effects"] == dict.fromkeys(applied, 1)


# -- the sync RedisLink vs redis-py's own connection ----------------------------------------


class PlainSyncPool(redis.ConnectionPool):  # type: ignore[misc]
    """Not redis-py's plain pool: the sync link then talks through
    ``client.execute_command`` (redis-py's own connection handling)."""


def run_sync_checker_schedule(schedule: Schedule, *, link: bool) -> dict[str, Any]:
    """:func:`run_checker_schedule` on the thread driver: ``@idempotent(RedisChecker)``
    over the sync link or redis-py's connection, the checker's connections killed every
    ``fault_every``-th handler run."""
    from msgpatterns.idempotency import RedisChecker

    unique = uuid.uuid4().hex[:10]
    name = f"diff-sync-checker-{unique}"
    url = with_client_name(services.require("redis"), name)
    admin = redis.Redis.from_url(services.require("redis"))
    broker = InMemoryBroker()
    topic = "orders"
    kinds = {f"k{i}": kind for i, kind in enumerate(schedule.kinds)}
    label: dict[str | None, str] = {}
    for copy in (1, 2):
        for key in kinds:
            label[broker.publish(topic, key.encode(), key=key)] = f"{key}#{copy}"
    effects: collections.Counter[str] = collections.Counter()
    runs = [0]
    lock = threading.Lock()
    total = 2 * len(kinds)
    client = (redis.Redis.from_url(url) if link else
              redis.Redis(connection_pool=PlainSyncPool.from_url(url)))
    checker = RedisChecker(client, namespace=f"diff-{unique}", ttl=600, lease=1)
    assert checker.store.link._direct is link  # each twin on the path it names

    @idempotent(checker, group="g")
    def handle(message: Message) -> None:
        key = str(message.key)
        with lock:
            runs[0] += 1
            run = runs[0]
        if schedule.fault_every and run % schedule.fault_every == 0:
            kill_named(admin, name)
        kind = kinds[key]
        if kind == "slow":
            time.sleep(0.005)  # the workload: a slow handler, not synchronisation
        elif kind == "fail_once" and message.attempt == 1:
            raise RuntimeError("first attempt fails")
        elif kind == "reject":
            raise Reject("rejected by the schedule")
        with lock:
            effects[key] += 1

    def settled() -> bool:
        return len(broker.acked) + len(broker.dead_letters) >= total

    try:
        for part in range(2):
            consumer = Consumer(broker, handle, topics=[topic], group="g", workers=4,
                                max_in_flight=8, retry=CHECKER_POLICY, poll_timeout=0.02)
            consumer.start()
            give_up = time.monotonic() + 60
            while not settled() and time.monotonic() < give_up:
                if part == 0 and schedule.stop_after is not None \
                        and runs[0] >= schedule.stop_after:
                    break
                time.sleep(0.01)  # polling the fake's counters
            consumer.stop(schedule.stop_timeout if part == 0 else 5)
            if settled():
                break
    finally:
        checker.close()
        client.close()
        admin.close()
    return {"effects": dict(effects),
            "acked": {label[m.id] for m in broker.acked},
            "dead": {label[d.message.id] for d in broker.dead_letters},
            "pending": broker.pending}


@profile(0.08)
@given(schedule=schedules)
def test_sync_redis_link_and_redis_py_connection_agree(schedule: Schedule) -> None:
    ours = run_sync_checker_schedule(schedule, link=True)
    theirs = run_sync_checker_schedule(schedule, link=False)
    applied = {f"k{i}" for i, kind in enumerate(schedule.kinds) if kind != "reject"}
    for run in (ours, theirs):
        assert set(run["effects"]) == applied
        assert run["pending"] == 0
    assert ours["acked"] == theirs["acked"]
    assert ours["dead"] == theirs["dead"]
    if schedule.stop_after is None:
        assert ours["effects"] == theirs["effects"] == dict.fromkeys(applied, 1)
