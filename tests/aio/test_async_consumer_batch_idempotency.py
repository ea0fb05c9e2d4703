"""Batch claims in the AsyncConsumer: an async ``@idempotent`` handler's keys are
claimed per batch of ready messages in one store round trip and completed in one, DONE
written before the acks - the async twin of tests/test_consumer_batch_idempotency.py, on
MemoryChecker, AsyncRedisChecker (fakeredis, real Redis) and AsyncSqlChecker (SQLite,
PostgreSQL). The rules are BatchGuard's, shared with the sync Consumer; only the I/O
is awaited."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from async_db import async_url

from msgpatterns import Backoff, Message, NeedRetry, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.errors import InProgress
from msgpatterns.idempotency import (
    AsyncRedisChecker,
    AsyncSqlChecker,
    AsyncTransactionalSqlChecker,
    LeaseChecker,
    MemoryChecker,
    RedisChecker,
    SqlChecker,
    Status,
    idempotent,
)
from msgpatterns.idempotency.batch import guard_of
from msgpatterns.testing import EffectLog, services

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

LEASE_STORES = [
    "memory",
    "fakeredis",
    "sqlite",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
#: Stores whose clock the test can drive (the broker's virtual clock).
CLOCKED_STORES = ["memory", "sqlite"]
QUICK = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0)
GROUP = "billing.handle"


class Crash(BaseException):
    """The process dies here (a BaseException: nothing on the way handles it)."""


class Store:
    """An async checker on one store, and a sync checker on the same keys (to act as
    another consumer, and to look at what the store holds)."""

    def __init__(self, checker: Any, sync: Any) -> None:
        self.checker = checker
        self.sync = sync

    def status(self, key: str) -> Status:
        """What another consumer finds for ``key`` now (claims it if absent)."""
        found: Status = self.sync.claim(key, group=GROUP).status
        return found


@asynccontextmanager
async def store_for(kind: str, tmp_path: Path, **options: Any) -> AsyncIterator[Store]:
    """An async checker on ``kind`` with its own namespace or table, dropped after."""
    suffix = uuid.uuid4().hex[:10]
    if kind == "memory":
        memory = MemoryChecker(**options)
        yield Store(memory, memory)
        return
    if kind in ("fakeredis", "redis"):
        options.pop("clock", None)  # Redis keeps time itself
        namespace = f"test-{suffix}"
        if kind == "fakeredis":
            import fakeredis

            server = fakeredis.FakeServer()
            client: Any = fakeredis.FakeAsyncRedis(server=server)
            sync_client: Any = fakeredis.FakeRedis(server=server)
        else:
            url = services.require("redis")
            client, sync_client = url, url
        checker: Any = AsyncRedisChecker(client, namespace=namespace, **options)
        sync: Any = RedisChecker(sync_client, namespace, **options)
        try:
            yield Store(checker, sync)
        finally:
            keys = list(sync.client.scan_iter(match=f"{namespace}:*", count=1000))
            if keys:
                sync.client.delete(*keys)
            await checker.aclose()
            sync.close()
        return
    url = f"sqlite:///{tmp_path / 'dedup.db'}" if kind == "sqlite" \
        else services.require(kind)
    table = f"dedup_{suffix}"
    checker = AsyncSqlChecker(async_url(url), table, **options)
    sync = SqlChecker(url, table, **options)
    try:
        yield Store(checker, sync)
    finally:
        sync.store.table.drop()
        await checker.aclose()
        sync.close()


@pytest.fixture(params=LEASE_STORES)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    async with store_for(request.param, tmp_path) as made:
        yield made


class RoundTrips:
    """Counts the store round trips of a checker (wraps its batch I/O: the sync store
    of a MemoryChecker, the awaited store of an async checker)."""

    def __init__(self, checker: Any) -> None:
        self.calls: Counter[str] = Counter()
        self.keys: Counter[str] = Counter()
        store = checker.store if isinstance(checker, LeaseChecker) else checker.astore
        for operation in ("claim_many", "complete_many", "release_many"):
            io = getattr(store, operation)
            counting = self._counting(operation, io)
            setattr(store, operation, counting)

    def _counting(self, name: str, io: Callable[[Any], Any]) -> Callable[[Any], Any]:
        if asyncio.iscoroutinefunction(io):
            async def acall(items: Any) -> Any:
                self.count(name, items)
                return await io(items)
            return acall

        def call(items: Any) -> Any:
            self.count(name, items)
            return io(items)
        return call

    def count(self, name: str, items: Any) -> None:
        self.calls[name] += 1
        self.keys[name] += len(items)


async def publish(broker: AsyncInMemoryBroker, count: int, prefix: str = "o") -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(count)]
    for message_id in ids:
        await broker.publish("orders", {"id": message_id}, id=message_id)
    return ids


async def consume(broker: AsyncInMemoryBroker, handler: Any,
                  **options: Any) -> AsyncConsumer:
    consumer = AsyncConsumer(broker, handler, topics=["orders"], group="billing", **options)
    await consumer.run_until_idle(timeout=60)
    return consumer


def ack_then_fail(first: Message, second: Message) -> None:
    """Settle two parked messages from a foreign thread: the first acked, the second
    failed (its claim is released and it is retried)."""
    first.ack()
    second.ack(ConnectionError("write failed"))


def assert_all_acked(broker: AsyncInMemoryBroker) -> None:
    assert broker.pending == 0
    assert not broker.dead_letters


async def test_one_claim_and_one_completion_round_trip_per_fetched_batch(
        store: Store) -> None:
    broker = AsyncInMemoryBroker()
    ids = await publish(broker, 12)
    trips = RoundTrips(store.checker)
    effects = EffectLog()

    @idempotent(store.checker, group=GROUP)
    async def handle(message: Message) -> None:
        await asyncio.sleep(0)
        effects.record(message.id)

    assert guard_of(handle) is not None
    consumer = await consume(broker, handle, fetch_batch=12, max_in_flight=12)
    effects.assert_exactly_once(ids)
    assert_all_acked(broker)
    assert consumer.stats.acked == 12
    assert trips.calls["claim_many"] == 1 and trips.keys["claim_many"] == 12
    assert trips.calls["complete_many"] == 1 and trips.keys["complete_many"] == 12
    assert trips.calls["release_many"] == 0


@pytest.mark.parametrize("kind", ["memory", "fakeredis", "sqlite"])
async def test_the_acks_go_out_only_after_done_is_written(kind: str,
                                                          tmp_path: Path) -> None:
    broker = AsyncInMemoryBroker()
    await publish(broker, 8)
    seen_at_ack: list[Status] = []
    async with store_for(kind, tmp_path) as made:
        acked = broker.ack

        async def ack(message: Message) -> None:
            # What another consumer finds for this key at the moment of the ack.
            seen_at_ack.append(made.status(str(message.id)))
            await acked(message)

        broker.ack = ack  # type: ignore[method-assign]

        @idempotent(made.checker, group=GROUP)
        async def handle(message: Message) -> None:
            await asyncio.sleep(0)

        await consume(broker, handle, fetch_batch=8)
    assert seen_at_ack == [Status.DONE] * 8


async def test_duplicates_in_the_batch_and_keys_done_before_are_skipped_and_acked(
        store: Store) -> None:
    broker = AsyncInMemoryBroker()
    effects = EffectLog()

    @idempotent(store.checker, group=GROUP)
    async def handle(message: Message) -> None:
        effects.record(message.id)

    ids = await publish(broker, 4, prefix="first")
    await consume(broker, handle)
    # One batch: two keys done before, one key three times, one new key.
    for message_id in [ids[0], "new-1", "new-2", ids[1], "new-1", "new-1"]:
        await broker.publish("orders", {"id": message_id}, id=message_id)
    trips = RoundTrips(store.checker)
    await consume(broker, handle, fetch_batch=16)
    effects.assert_exactly_once([*ids, "new-1", "new-2"])
    assert_all_acked(broker)
    # The copies of new-1 wait for their batch to finish, then are duplicates: one more
    # claim round trip, never a retry.
    assert trips.calls["claim_many"] == 2 and trips.calls["complete_many"] == 1
    assert store.checker.stats.duplicates == 4


@pytest.mark.parametrize("kind", CLOCKED_STORES)
async def test_a_key_in_progress_elsewhere_is_retried_after_the_lease(
        kind: str, tmp_path: Path) -> None:
    broker = AsyncInMemoryBroker()
    async with store_for(kind, tmp_path, lease=5, clock=broker.now) as made:
        await publish(broker, 3)
        started = broker.now()  # the lease runs from the claim below
        # Another consumer holds o-1 (and dies).
        assert made.sync.claim("o-1", group=GROUP).status is Status.CLAIMED
        runs: list[tuple[str | None, int]] = []

        @idempotent(made.checker, group=GROUP)
        async def handle(message: Message) -> None:
            runs.append((message.id, message.attempt))

        await consume(broker, handle, retry=QUICK)
        assert sorted(runs) == [("o-0", 1), ("o-1", 2), ("o-2", 1)]
        assert broker.now() - started >= 5  # o-1 came back once the lease ran out
        assert made.checker.stats.in_progress == 1
        assert_all_acked(broker)


async def test_a_failing_handler_releases_its_claim_and_is_retried(store: Store) -> None:
    broker = AsyncInMemoryBroker()
    ids = await publish(broker, 6)
    trips = RoundTrips(store.checker)
    effects = EffectLog()
    attempts: list[tuple[str | None, int]] = []

    @idempotent(store.checker, group=GROUP)
    async def handle(message: Message) -> None:
        attempts.append((message.id, message.attempt))
        if message.id in ("o-2", "o-4") and message.attempt == 1:
            raise ConnectionError("downstream down")
        effects.record(message.id)

    await consume(broker, handle, retry=QUICK, fetch_batch=6)
    effects.assert_exactly_once(ids)
    assert sorted(a for a in attempts if a[0] in ("o-2", "o-4")) == [
        ("o-2", 1), ("o-2", 2), ("o-4", 1), ("o-4", 2)]
    assert store.checker.stats.released == 2 and store.checker.stats.in_progress == 0
    assert trips.keys["release_many"] == 2  # each as its handler raised
    assert_all_acked(broker)


async def test_ordered_mode_claims_what_it_admits_as_one_batch(store: Store) -> None:
    broker = AsyncInMemoryBroker()
    expected: dict[str, list[int]] = {}
    for seq in range(4):
        for account in ("a", "b", "c"):
            await broker.publish("orders", {"seq": seq}, key=account, id=f"{account}-{seq}")
            expected.setdefault(account, []).append(seq)
    seen: dict[str, list[int]] = {}
    trips = RoundTrips(store.checker)

    # The idempotency key is the message id; the ordering key is message.key.
    @idempotent(store.checker, key=lambda m: m.id, group=GROUP)
    async def handle(message: Message) -> None:
        if message.id == "b-1" and message.local_retries == 0:
            raise NeedRetry()  # a local retry holds b's later messages back
        await asyncio.sleep(0)
        seen.setdefault(message.key or "", []).append(message.body["seq"])

    await consume(broker, handle, ordered=True)
    assert seen == expected
    assert_all_acked(broker)
    # At most one message per key is admitted at a time: a claim round trip covers
    # every key's head, so there are fewer round trips than messages.
    assert trips.calls["claim_many"] < trips.keys["claim_many"] == 13
    assert store.checker.stats.released == 1


async def test_explicit_ack_completes_the_claim_when_the_message_is_acked(
        store: Store) -> None:
    broker = AsyncInMemoryBroker()
    ids = await publish(broker, 6)
    parked: list[Message] = []
    effects = EffectLog()
    acks: list[str] = []
    acked = broker.ack

    async def ack(message: Message) -> None:
        acks.append(str(message.id))
        await acked(message)

    broker.ack = ack  # type: ignore[method-assign]

    @idempotent(store.checker, group=GROUP)
    async def handle(message: Message) -> None:
        effects.record(message.id)
        if message.attempt > 1 or message.id not in ("o-1", "o-3"):
            return
        message.disable_auto_ack()
        parked.append(message)
        if len(parked) == 2:  # both parked: settled later, from another thread
            threading.Thread(target=ack_then_fail, args=parked).start()

    await consume(broker, handle, retry=QUICK, fetch_batch=6)
    assert Counter(effects.order) == Counter({**dict.fromkeys(ids, 1), "o-3": 2})
    # Every key is DONE (the explicit ack completed o-1's claim before acking it).
    assert {store.status(key) for key in ids} == {Status.DONE}
    assert sorted(acks) == sorted(ids)
    assert store.checker.stats.released == 1
    assert_all_acked(broker)


@pytest.mark.parametrize("kind", CLOCKED_STORES)
async def test_a_crash_before_the_batch_completion_reruns_its_messages_after_the_lease(
        kind: str, tmp_path: Path) -> None:
    """The documented window: effects applied, completion never written, the process
    dies; the keys stay PROCESSING until their lease (from the batch's claim) expires,
    then the redelivered messages run again (at-least-once)."""
    broker = AsyncInMemoryBroker()
    async with store_for(kind, tmp_path, lease=10, clock=broker.now) as made:
        checker = made.checker
        ids = await publish(broker, 5)
        effects = EffectLog()
        ran_at: list[float] = []

        @idempotent(checker, group=GROUP)
        async def handle(message: Message) -> None:
            effects.record(message.id)
            ran_at.append(broker.now())

        crashed = asyncio.Event()
        claimed_at: list[float] = []
        store_io = checker.store if isinstance(checker, LeaseChecker) else checker.astore
        claim_records = store_io.claim_many

        if asyncio.iscoroutinefunction(claim_records):
            async def claim(requests: Any) -> Any:
                claimed_at.append(broker.now())
                return await claim_records(requests)
        else:
            def claim(requests: Any) -> Any:
                claimed_at.append(broker.now())
                return claim_records(requests)

        def crash(*args: Any) -> Any:
            crashed.set()
            raise Crash("the process dies here")

        store_io.claim_many = claim
        complete_records = store_io.complete_many
        store_io.complete_many = crash
        first = AsyncConsumer(broker, handle, topics=["orders"], group="billing",
                              fetch_batch=5)
        await first.start()
        await asyncio.wait_for(crashed.wait(), 10)
        await first.stop(0)  # what a dead process leaves: nothing acked, keys PROCESSING
        store_io.complete_many = complete_records
        assert len(effects.order) == 5 and not broker.acked

        await consume(broker, handle, retry=QUICK)
        assert Counter(effects.order) == Counter(dict.fromkeys(ids, 2))
        assert min(ran_at[5:]) >= claimed_at[0] + 10  # not before the lease ran out
        assert_all_acked(broker)


async def test_transactional_checker_keeps_one_transaction_per_message(
        tmp_path: Path) -> None:
    broker = AsyncInMemoryBroker()
    ids = await publish(broker, 4)
    checker = AsyncTransactionalSqlChecker(f"sqlite+aiosqlite:///{tmp_path / 'tx.db'}",
                                           "dedup_tx")
    try:
        effects = EffectLog()

        @idempotent(checker, group=GROUP)
        async def handle(message: Message, tx: Any) -> None:
            effects.record(message.id)

        assert guard_of(handle) is None  # no batch claims: its claim is in tx
        await consume(broker, handle)
        effects.assert_exactly_once(ids)
        assert checker.stats.claimed == 4 and checker.stats.completed == 4
    finally:
        await checker.aclose()


async def test_a_key_in_progress_in_a_batch_is_not_run(store: Store) -> None:
    """A key another consumer holds is settled with InProgress (never run) while the
    rest of its batch runs and is completed."""
    broker = AsyncInMemoryBroker()
    await publish(broker, 3)
    assert store.sync.claim("o-0", group=GROUP).status is Status.CLAIMED
    ran: list[str | None] = []

    @idempotent(store.checker, group=GROUP)
    async def handle(message: Message) -> None:
        ran.append(message.id)

    consumer = AsyncConsumer(broker, handle, topics=["orders"], group="billing",
                             retry=RetryPolicy(max_attempts=1, local_retries=0))
    await consumer.run_until_idle(timeout=60)
    assert sorted(ran) == ["o-1", "o-2"]
    assert [d.error_type.rsplit(".", 1)[-1] for d in broker.dead_letters] == [
        InProgress.__name__]


@pytest.mark.parametrize("kind", ["fakeredis", "sqlite"])
async def test_fast_mode_queues_the_batch_completions_behind(kind: str,
                                                             tmp_path: Path) -> None:
    """With ``write_behind`` the batch's completions are queued (acked at once) and
    written within that interval; the keys are DONE once flushed."""
    broker = AsyncInMemoryBroker()
    ids = await publish(broker, 6)
    async with store_for(kind, tmp_path, write_behind=0.05) as made:
        trips = RoundTrips(made.checker)

        @idempotent(made.checker, group=GROUP)
        async def handle(message: Message) -> None:
            await asyncio.sleep(0)

        await consume(broker, handle, fetch_batch=6)
        assert_all_acked(broker)
        await made.checker.aflush()
        assert trips.calls["claim_many"] == 1
        assert trips.calls["complete_many"] >= 1 and trips.keys["complete_many"] == 6
        assert {made.status(key) for key in ids} == {Status.DONE}


async def test_a_claim_is_completed_when_its_handler_returns_not_when_its_batch_ends(
        store: Store) -> None:
    """Issue 19: the early messages of a batch are DONE and acked while a later one of
    the same batch still runs - never held back until the batch's last handler ends."""
    broker = AsyncInMemoryBroker()
    ids = await publish(broker, 6)
    seen: list[bool] = []

    def all_done() -> bool:
        return {store.status(i) for i in ids[:-1]} == {Status.DONE} \
            and len(broker.acked) == 5

    @idempotent(store.checker, group=GROUP)
    async def handle(message: Message) -> None:
        if message.id == ids[-1]:  # the last of the batch waits for the others' DONE
            for _ in range(2000):
                if all_done():
                    break
                await asyncio.sleep(0.005)
            seen.append(all_done())

    await consume(broker, handle, fetch_batch=6, max_in_flight=6)
    assert seen == [True]
    assert_all_acked(broker)
