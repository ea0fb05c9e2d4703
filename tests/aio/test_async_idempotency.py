"""``@idempotent`` on ``async def`` handlers (issue 12 item 3): the six rules through
the async checkers - MemoryChecker, AsyncRedisChecker (redis.asyncio, the real Redis),
AsyncSqlChecker on aiosqlite and the real PostgreSQL (psycopg 3 async) and MariaDB
(aiomysql) - each beside its sync sibling on the same store, which sees the same keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from async_db import async_url

from msgpatterns import Message, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.errors import IdempotencyConflict, InProgress, NeedRetry
from msgpatterns.idempotency import (
    AsyncRedisChecker,
    AsyncSqlChecker,
    MemoryChecker,
    RedisChecker,
    SqlChecker,
    Status,
    StorePolicy,
    idempotent,
)
from msgpatterns.retry import Backoff
from msgpatterns.testing import services
from msgpatterns.testing.checker_fixtures import FakeClock

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

STORES = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
]


def sql_url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'dedup.db'}"
    return services.require(kind)


@dataclass
class Pair:
    """An async checker and a sync one on the same store (same keys)."""

    kind: str
    checker: Any
    sync: Any
    expire: Callable[[str], Any]

    async def expire_key(self, key: str) -> None:
        """Let ``key``'s lease (or ttl) run out now."""
        await self.expire(self.checker.store_key(key, "g"))


async def _pair(kind: str, tmp_path: Path, **options: Any) -> Pair:
    suffix = uuid.uuid4().hex[:10]
    clock = FakeClock()

    async def advance(key: str) -> None:
        clock.advance(3600)

    if kind == "memory":
        memory = MemoryChecker(clock=clock, **options)
        return Pair(kind, memory, memory, advance)
    if kind == "redis":
        url = services.require("redis")
        namespace = f"test-{suffix}"
        checker: Any = AsyncRedisChecker(url, namespace=namespace, **options)
        sync: Any = RedisChecker(url, namespace, **options)

        async def expire(key: str) -> None:
            sync.client.pexpire(key, 1)
            while sync.client.exists(key):
                await asyncio.sleep(0.005)

        return Pair(kind, checker, sync, expire)
    url = sql_url(kind, tmp_path)
    table = f"dedup_{suffix}"
    checker = AsyncSqlChecker(async_url(url), table, clock=clock, **options)
    sync = SqlChecker(url, table, clock=clock, **options)
    return Pair(kind, checker, sync, advance)


@pytest.fixture(params=STORES)
async def pair(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Pair]:
    made = await _pair(request.param, tmp_path)
    try:
        yield made
    finally:
        await _drop(made)


async def _drop(made: Pair) -> None:
    if made.kind == "redis":
        keys = list(made.sync.client.scan_iter(match=f"{made.sync.namespace}:*"))
        if keys:
            made.sync.client.delete(*keys)
    elif made.kind != "memory":
        made.sync.store.table.drop()
    await made.checker.aclose()
    made.sync.close()


class Effects:
    """What handlers did, per key."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()


async def test_runs_once_and_skips_the_duplicate(pair: Pair) -> None:
    effects = Effects()

    @idempotent(pair.checker, group="g")
    async def handle(message: Message) -> str:
        await asyncio.sleep(0)
        effects.count[str(message.key)] += 1
        return "paid"

    assert await handle(Message({}, key="o-1")) == "paid"
    assert await handle(Message({}, key="o-1")) is None  # a duplicate: skipped
    assert effects.count == Counter({"o-1": 1})
    assert pair.checker.stats.completed == 1 and pair.checker.stats.duplicates == 1
    assert pair.sync.claim("o-1", group="g").status is Status.DONE  # the sync side sees it


async def test_a_failing_body_releases_the_key_and_is_retried_never_skipped(
        pair: Pair) -> None:
    """The hole of issue 12: DONE must never be written before the body ran. A body that
    fails releases its claim; the redelivery runs it again."""
    attempts: list[str] = []

    @idempotent(pair.checker, group="g")
    async def handle(message: Message) -> str:
        await asyncio.sleep(0)
        attempts.append(str(message.key))
        if len(attempts) == 1:
            raise RuntimeError("the body failed")
        return "ok"

    with pytest.raises(RuntimeError, match="the body failed"):
        await handle(Message({}, key="o-1"))
    assert pair.sync.claim("o-1", group="g").status is Status.CLAIMED  # released: free
    await pair.expire_key("o-1")  # that probe's own claim runs out
    assert await handle(Message({}, key="o-1")) == "ok"
    assert await handle(Message({}, key="o-1")) is None
    assert attempts == ["o-1", "o-1"]
    assert pair.checker.stats.released == 1


async def test_a_cancelled_body_releases_the_key(pair: Pair) -> None:
    started = asyncio.Event()

    @idempotent(pair.checker, group="g")
    async def handle(message: Message) -> None:
        started.set()
        await asyncio.Event().wait()  # never set: cancelled while it runs

    task = asyncio.create_task(handle(Message({}, key="o-1")))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pair.checker.stats.released == 1
    assert pair.sync.claim("o-1", group="g").status is Status.CLAIMED  # free again


async def test_two_tasks_same_key_one_runs_the_other_is_in_progress(pair: Pair) -> None:
    inside = asyncio.Event()
    leave = asyncio.Event()
    runs: list[str] = []

    @idempotent(pair.checker, group="g")
    async def handle(message: Message) -> str:
        runs.append(str(message.key))
        inside.set()
        await leave.wait()
        return "done"

    first = asyncio.create_task(handle(Message({}, key="o-1")))
    await inside.wait()
    with pytest.raises(InProgress) as raised:
        await handle(Message({}, key="o-1"))
    assert 0 < raised.value.delay <= 30
    leave.set()
    assert await first == "done"
    assert await handle(Message({}, key="o-1")) is None
    assert runs == ["o-1"]


async def test_a_dead_owners_key_is_taken_over_when_its_lease_expires(pair: Pair) -> None:
    runs: list[str] = []

    @idempotent(pair.checker, group="g")
    async def handle(message: Message) -> None:
        runs.append(str(message.key))

    dead = pair.sync.claim("o-1", group="g")  # a process that died mid-way
    assert dead.claimed
    with pytest.raises(InProgress):
        await handle(Message({}, key="o-1"))
    await pair.expire_key("o-1")
    await handle(Message({}, key="o-1"))
    assert runs == ["o-1"]
    assert not pair.sync.complete(dead)  # the dead owner's late completion: lost lease


async def test_fingerprints_and_stored_results(pair: Pair) -> None:
    @idempotent(pair.checker, group="g", fingerprint=True, store_result=True)
    async def handle(message: Message) -> dict[str, Any]:
        return {"total": message.body["n"] * 2}

    assert await handle(Message({"n": 2}, key="o-1")) == {"total": 4}
    assert await handle(Message({"n": 2}, key="o-1")) == {"total": 4}  # the stored result
    with pytest.raises(IdempotencyConflict):
        await handle(Message({"n": 3}, key="o-1"))


@pytest.mark.parametrize("kind", [s for s in STORES if s != "memory"])
async def test_fast_mode_writes_completions_behind(kind: str, tmp_path: Path) -> None:
    """write_behind (fast) against strict: the completion is queued, a duplicate in
    this process is skipped at once, and the store has it after ``aflush``; strict
    mode has it before the call returns."""
    fast = await _pair(kind, tmp_path, write_behind=5.0)
    try:
        @idempotent(fast.checker, group="g")
        async def handle(message: Message) -> str:
            return "ok"

        assert await handle(Message({}, key="o-1")) == "ok"
        assert await handle(Message({}, key="o-1")) is None  # pending here: DONE
        assert fast.sync.claim("o-1", group="g").status is Status.IN_PROGRESS  # not yet
        await fast.checker.aflush()
        assert fast.sync.claim("o-2", group="g").claimed
        assert fast.sync.claim("o-1", group="g").status is Status.DONE
    finally:
        await _drop(fast)
    strict = await _pair(kind, tmp_path)
    try:
        @idempotent(strict.checker, group="g")
        async def handle_strict(message: Message) -> str:
            return "ok"

        assert await handle_strict(Message({}, key="o-1")) == "ok"
        assert strict.sync.claim("o-1", group="g").status is Status.DONE
    finally:
        await _drop(strict)


async def test_an_unreachable_store_asks_for_a_retry(tmp_path: Path) -> None:
    """Rule 6 on the async path: transient errors retried, then NeedRetry; nothing ran."""
    checker = AsyncRedisChecker("redis://127.0.0.1:1/0", namespace="x",
                                policy=StorePolicy(attempts=2, backoff=Backoff.fixed(0),
                                                   unavailable_delay=7.0))
    runs: list[str] = []

    @idempotent(checker)
    async def handle(message: Message) -> None:
        runs.append("ran")

    with pytest.raises(NeedRetry) as raised:
        await handle(Message({}, id="m-1"))
    assert raised.value.delay == 7.0 and runs == []
    assert checker.stats.store_errors == 2 and checker.stats.unavailable == 1
    await checker.aclose()


async def test_through_the_async_consumer_each_key_applies_once(pair: Pair) -> None:
    """AsyncConsumer with an @idempotent async handler: duplicates published and a
    first attempt that fails; every key is applied once, every delivery acked."""
    broker = AsyncInMemoryBroker()
    applied: Counter[str] = Counter()
    failed: set[str] = set()

    @idempotent(pair.checker, group="g")
    async def handle(message: Message) -> None:
        key = str(message.key)
        if key not in failed:
            failed.add(key)
            raise RuntimeError("first attempt fails")
        applied[key] += 1

    keys = [f"o-{i}" for i in range(10)]
    for key in keys + keys:
        await broker.publish("orders", {}, key=key)
    consumer = AsyncConsumer(broker, handle, topics=["orders"], group="billing",
                             max_in_flight=4,
                             retry=RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0),
                                               local_retries=0))
    await consumer.run_until_idle()
    assert applied == Counter(dict.fromkeys(keys, 1))
    assert consumer.stats.acked == 20


def test_misuse_is_refused_at_decoration(tmp_path: Path) -> None:
    sync = SqlChecker(f"sqlite:///{tmp_path / 'a.db'}")
    aio = AsyncSqlChecker(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")

    async def handler(message: Message) -> None: ...

    def sync_handler(message: Message) -> None: ...

    with pytest.raises(TypeError, match="use AsyncSqlChecker"):
        idempotent(sync)(handler)
    with pytest.raises(TypeError, match="use SqlChecker for a sync handler"):
        idempotent(aio)(sync_handler)
    sync.close()


@pytest.mark.redis
def test_an_async_redis_checker_serves_one_event_loop_after_another() -> None:
    """asyncio.run twice with one checker (a script, a test suite): the connections
    of the first loop are not reused on the second."""
    url = services.require("redis")
    checker = AsyncRedisChecker(url, namespace=f"test-{uuid.uuid4().hex[:10]}")
    runs: list[str] = []

    @idempotent(checker)
    async def handle(message: Message) -> None:
        runs.append(str(message.id))

    asyncio.run(handle(Message({}, id="m-1")))
    asyncio.run(handle(Message({}, id="m-1")))  # a duplicate, on a new loop
    asyncio.run(handle(Message({}, id="m-2")))
    assert runs == ["m-1", "m-2"]
    asyncio.run(checker.aclose())
