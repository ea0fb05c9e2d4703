"""Rule 6: an unreachable store is retried, then the message is retried later
(NeedRetry with a delay). Nothing is processed without dedup unless asked for."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import sqlalchemy as sa

from msgpatterns import Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.errors import NeedRetry
from msgpatterns.idempotency import (
    RedisChecker,
    SqlChecker,
    Status,
    StorePolicy,
    TransactionalSqlChecker,
    idempotent,
)
from msgpatterns.idempotency.base import Checker
from msgpatterns.retry import Backoff
from msgpatterns.testing import EffectLog
from msgpatterns.testing.checker_fixtures import checker_for, store_params

FAST = StorePolicy(attempts=3, wait=0.0, max_wait=0.0, unavailable_delay=7.0)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def unreachable_checkers(tmp_path: Path) -> list[Checker]:
    port = closed_port()
    return [
        RedisChecker(f"redis://127.0.0.1:{port}/0", policy=FAST),
        SqlChecker(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test", policy=FAST),
        SqlChecker(f"mysql+pymysql://root@127.0.0.1:{port}/test", policy=FAST),
        SqlChecker(f"sqlite:///{tmp_path}/missing-dir/dedup.db", policy=FAST),
        TransactionalSqlChecker(f"sqlite:///{tmp_path}/missing-dir/dedup.db", policy=FAST),
    ]


@pytest.mark.parametrize("index", range(5), ids=["redis", "postgres", "mysql", "sqlite",
                                                  "transactional-sqlite"])
def test_an_unreachable_store_is_retried_then_asks_for_a_later_delivery(
    index: int, tmp_path: Path,
) -> None:
    checker = unreachable_checkers(tmp_path)[index]
    effects = EffectLog()

    @idempotent(checker)
    def handle(message: Message, tx: object = None) -> None:
        effects.record(message.key)

    with pytest.raises(NeedRetry, match="store unavailable") as caught:
        handle(Message(b"", key="k"))
    assert caught.value.delay == 7.0
    assert len(effects) == 0  # never processed without dedup
    assert checker.stats.store_errors == 3  # every attempt was made
    assert checker.stats.unavailable == 1


def test_fail_open_processes_without_dedup_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    checker = unreachable_checkers(tmp_path)[0]
    effects = EffectLog()

    @idempotent(checker, fail_open=True)
    def handle(message: Message) -> str:
        effects.record(message.key)
        return "done"

    assert handle(Message(b"", key="k")) == "done"
    assert effects.order == ["k"]
    assert checker.stats.processed_without_dedup == 1
    assert any(r.levelno == logging.WARNING and "WITHOUT dedup" in r.getMessage()
               for r in caplog.records)


class RecoveringRedis(fakeredis.FakeRedis):
    """A fakeredis client whose server is unreachable for its first ``down`` commands."""

    def __init__(self, down: int) -> None:
        super().__init__(server=fakeredis.FakeServer())
        self.down = down
        self.calls = 0

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.connection_pool.connection_kwargs["server"].connected = self.calls > self.down
        return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]


def test_a_store_that_comes_back_within_the_retries_is_transparent() -> None:
    checker = RedisChecker(RecoveringRedis(down=2), policy=FAST)
    checker._link._direct = False  # commands through the client, where it counts them
    assert checker.claim("k").status is Status.CLAIMED
    assert checker.stats.store_errors == 2


def test_the_consumer_never_acks_a_message_whose_store_stays_down() -> None:
    server = fakeredis.FakeServer()
    server.connected = False
    checker = RedisChecker(fakeredis.FakeRedis(server=server), policy=FAST)
    broker = InMemoryBroker(seed=1)
    broker.publish("orders", b"pay", key="o-1")
    effects = EffectLog()

    @idempotent(checker)
    def handle(message: Message) -> None:
        effects.record(message.key)

    Consumer(broker, handle, topics=["orders"], group="g",
             retry=RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1.0), local_retries=0),
             ).run_until_idle(timeout=30)
    assert len(effects) == 0
    assert broker.acked == []
    (dead,) = broker.dead_letters  # kept with its reason, not lost
    assert "store unavailable" in dead.error_message
    assert dead.attempts == 3


# -- a connection killed under the checker ------------------------------------------------------

@pytest.mark.redis
def test_a_killed_redis_connection_is_replaced_transparently(tmp_path: Path) -> None:
    with checker_for("redis", tmp_path) as checker:
        assert isinstance(checker, RedisChecker)
        assert checker.claim("before").claimed
        victim = checker._link.call("CLIENT", "ID")  # this thread's connection
        killer = checker.client.__class__.from_url(checker.spec().url)
        assert killer.client_kill_filter(_id=str(victim)) == 1
        killer.close()
        assert checker.claim("after").claimed  # the retry reconnected
        assert checker._link.call("CLIENT", "ID") != victim
        assert checker.stats.store_errors == 1


@pytest.mark.parametrize("store", store_params("postgres", "mysql"))
@pytest.mark.parametrize("transactional", [False, True])
def test_a_killed_database_connection_is_replaced_transparently(
    store: str, transactional: bool, tmp_path: Path,
) -> None:
    session_id = {"postgres": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}
    kill = {"postgres": "SELECT pg_terminate_backend(:id)", "mysql": "KILL :id"}
    with checker_for(store, tmp_path, transactional=transactional) as checker:
        assert isinstance(checker, SqlChecker | TransactionalSqlChecker)
        checker.create_table()
        checker.execute("before", lambda tx: None)
        with checker.engine.connect() as conn:  # the pool's only connection
            victim = conn.execute(sa.text(session_id[store])).scalar_one()
        killer = sa.create_engine(checker.store.url())
        with killer.connect() as conn:
            conn.execute(sa.text(kill[store]), {"id": victim})
        killer.dispose()
        assert checker.execute("after", lambda tx: "ran").result == "ran"
        assert checker.stats.store_errors >= 1


@pytest.mark.parametrize("batches", ["scripts", "pipelines"])
@pytest.mark.parametrize("store", store_params("fakeredis", "redis"))
def test_a_flushed_script_cache_is_reloaded(store: str, batches: str, tmp_path: Path) -> None:
    with checker_for(store, tmp_path) as checker:
        assert isinstance(checker, RedisChecker)
        if batches == "pipelines":  # the Redis Cluster way: one single-key call per key
            checker.store.scripts.chunk = 1
        assert checker.claim("a").claimed
        checker.client.script_flush()  # what a server restart or failover does
        claim = checker.claim("b")
        assert claim.claimed and checker.complete(claim)
        checker.client.script_flush()
        claims = checker.claim_many(["c", "d"])
        assert all(c.claimed for c in claims)
        checker.client.script_flush()
        assert checker.complete_many(claims) == [True, True]
        checker.client.script_flush()
        assert checker.release(checker.claim("e"))
        checker.client.script_flush()
        assert checker.release_many(checker.claim_many(["f", "g"])) == [True, True]
        assert [c.status.value for c in checker.claim_many(["c", "d", "f"])] == \
            ["done", "done", "claimed"]
        assert checker.stats.store_errors == 0


@pytest.mark.redis
def test_each_thread_and_each_forked_child_gets_its_own_connection(tmp_path: Path) -> None:
    import os
    import threading

    with checker_for("redis", tmp_path) as checker:
        assert isinstance(checker, RedisChecker)
        assert checker.claim("parent").claimed
        parent_id = checker._link.call("CLIENT", "ID")
        ids: list[int] = []
        thread = threading.Thread(target=lambda: ids.append(checker._link.call("CLIENT", "ID")))
        thread.start()
        thread.join()
        pid = os.fork()
        if pid == 0:  # the child: a fresh connection, never the parent's socket
            ok = checker.claim("child").claimed and \
                checker._link.call("CLIENT", "ID") != parent_id
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ids and ids[0] != parent_id
        assert checker._link.call("CLIENT", "ID") == parent_id  # the parent's is intact
        assert checker.claim("child").status.value == "in_progress"


@pytest.mark.parametrize("batch", [False, True], ids=["per-message", "batch-handler"])
def test_fail_open_handlers_run_in_a_consumer_whose_store_is_down(
    batch: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    """With batch claims (the default in a Consumer) and ``fail_open=True``, a store
    that is down used to leave every message unrun: the claim round gave them no claim,
    so the run refused to begin and each message hit its ack deadline, again and again.
    They run now, without dedup, as ``fail_open`` says (issue 22's parity notes)."""
    caplog.set_level(logging.CRITICAL)
    checker = RedisChecker(f"redis://127.0.0.1:{closed_port()}/0", policy=FAST)
    effects = EffectLog()
    broker = InMemoryBroker()
    for i in range(6):
        broker.publish("orders", b"x", key=f"k{i}")

    if batch:
        @idempotent(checker, fail_open=True)
        def handle_all(messages: list[Message]) -> None:
            for message in messages:
                effects.record(message.key)

        consumer = Consumer(broker, handle_all, topics="orders", group="g", batch=True,
                            ack_timeout=5, retry=RetryPolicy(max_attempts=2))
    else:
        @idempotent(checker, fail_open=True)
        def handle(message: Message) -> None:
            effects.record(message.key)

        consumer = Consumer(broker, handle, topics="orders", group="g", workers=2,
                            ack_timeout=5, retry=RetryPolicy(max_attempts=2))
    consumer.run_until_idle(timeout=30)
    assert sorted(effects.order) == [f"k{i}" for i in range(6)]
    assert consumer.stats.acked == 6
    assert checker.stats.processed_without_dedup == 6


@pytest.mark.parametrize("batch", [False, True], ids=["per-message", "batch-handler"])
def test_fail_open_handlers_run_in_an_async_consumer_whose_store_is_down(
    batch: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    """The asyncio driver's twin of the test above (the same claim rounds)."""
    import asyncio

    from msgpatterns import AsyncConsumer
    from msgpatterns.aio.memory import AsyncInMemoryBroker
    from msgpatterns.idempotency import AsyncRedisChecker

    caplog.set_level(logging.CRITICAL)
    effects = EffectLog()

    async def scenario() -> tuple[int, int]:
        checker = AsyncRedisChecker(f"redis://127.0.0.1:{closed_port()}/0", policy=FAST)
        broker = AsyncInMemoryBroker()
        for i in range(6):
            await broker.publish("orders", b"x", key=f"k{i}")
        if batch:
            @idempotent(checker, fail_open=True)
            async def handle_all(messages: list[Message]) -> None:
                for message in messages:
                    effects.record(message.key)

            consumer = AsyncConsumer(broker, handle_all, topics="orders", group="g",
                                     batch=True, ack_timeout=5,
                                     retry=RetryPolicy(max_attempts=2))
        else:
            @idempotent(checker, fail_open=True)
            async def handle(message: Message) -> None:
                effects.record(message.key)

            consumer = AsyncConsumer(broker, handle, topics="orders", group="g",
                                     ack_timeout=5, retry=RetryPolicy(max_attempts=2))
        await consumer.run_until_idle(timeout=30)
        await checker.aclose()
        return consumer.stats.acked, checker.stats.processed_without_dedup

    acked, without_dedup = asyncio.run(scenario())
    assert sorted(effects.order) == [f"k{i}" for i in range(6)]
    assert acked == 6 and without_dedup == 6
