"""Faults on real servers while >= 1,000 messages flow.

Each test identifies its OWN connections (client names, application_name, connection
names: other agents share these servers) and kills only those, a bounded number of
times, at progress points (every N handled messages: events, not sleeps). It then
asserts nothing was lost, nothing doubled where the path is transactional, and that
the consumer recovered by itself (all messages handled within a bound, nothing left
pending on the broker).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from reliability_harness import record_fault
from server_faults import close_rabbit_connections, quiet, rabbitmqctl

from msgpatterns import Consumer, idempotent
from msgpatterns.brokers.memory import InMemoryBroker
from msgpatterns.idempotency import RedisChecker, StorePolicy, TransactionalSqlChecker
from msgpatterns.message import Message
from msgpatterns.retry import Backoff, RetryPolicy
from msgpatterns.testing import services

__all__ = ["quiet"]  # a fixture, used by name

N = 1000
KILL_EVERY = 40  # handled messages between two kills
MAX_KILLS = 12
POLICY = RetryPolicy(max_attempts=1000, backoff=Backoff.fixed(0.05), local_retries=0)
STORE_POLICY = StorePolicy(attempts=5, wait=0.01, max_wait=0.2, unavailable_delay=0.1)


class Progress:
    """Counts effects per key; wakes a killer every ``every`` new effects and the test
    when every key has one."""

    def __init__(self, keys: list[str], every: int = KILL_EVERY) -> None:
        self.keys = keys
        self.effects: collections.Counter[str] = collections.Counter()
        self.every = every
        self.cond = threading.Condition()
        self.all_done = threading.Event()

    def applied(self, key: str) -> None:
        with self.cond:
            self.effects[key] += 1
            if len(self.effects) == len(self.keys):
                self.all_done.set()
            self.cond.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.effects) >= count, timeout)

    def lost(self) -> list[str]:
        return [k for k in self.keys if self.effects[k] == 0]

    def doubled(self) -> int:
        return sum(max(n - 1, 0) for n in self.effects.values())


class Killer(threading.Thread):
    """Calls ``kill()`` each time ``every`` more messages were handled, at most
    ``most`` times, until the work is done."""

    def __init__(self, progress: Progress, kill: Callable[[], int], most: int = MAX_KILLS,
                 every: int = KILL_EVERY) -> None:
        super().__init__(name="reliability-killer", daemon=True)
        self.progress, self.kill, self.most, self.every = progress, kill, most, every
        self.kills = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        target = self.every
        while self.kills < self.most and not self.stopped.is_set():
            if not self.progress.wait_for(target, timeout=0.5):
                if self.progress.all_done.is_set():
                    return
                continue
            self.kills += self.kill()
            target = len(self.progress.effects) + self.every
            if target >= len(self.progress.keys):
                return


def report(name: str, messages: int, kills: int, lost: int, doubled: int) -> None:
    """Into the session's reliability totals (printed in the terminal summary)."""
    record_fault(f"fault: {name}", messages, kills, lost, doubled)


# -- PostgreSQL: pg_terminate_backend on the transactional path ---------------------------


@pytest.mark.postgres
def test_pg_terminate_backend_transactional(unique: str, quiet: None) -> None:
    url = services.require("postgres")
    app = f"msgpatterns-rel-{unique}"
    engine = sa.create_engine(url, pool_size=6, pool_pre_ping=False,
                              connect_args={"application_name": app})
    admin = sa.create_engine(url, poolclass=sa.pool.NullPool)
    effects = sa.Table(f"rel_pgkill_fx_{unique}", sa.MetaData(),
                       sa.Column("item", sa.String(32), nullable=False))
    dedup = f"rel_pgkill_dd_{unique}"
    effects.create(engine)
    checker = TransactionalSqlChecker(engine, table=dedup, policy=STORE_POLICY,
                                      namespace=f"n{unique}")
    broker = InMemoryBroker(record_history=False, visibility_timeout=30)
    keys = [f"k{i}" for i in range(N)]
    progress = Progress(keys)

    @idempotent(checker, group="g")
    def handle(message: Message, tx: sa.Connection) -> None:
        tx.execute(effects.insert().values(item=message.key))
        tx.info.setdefault("after_commit", []).append(message.key)

    def on_commit(conn: sa.Connection) -> None:
        for key in conn.info.pop("after_commit", []):
            progress.applied(key)

    def on_rollback(conn: sa.Connection) -> None:
        conn.info.pop("after_commit", None)

    sa.event.listen(engine, "commit", on_commit)
    sa.event.listen(engine, "rollback", on_rollback)

    def kill() -> int:
        with admin.connect() as conn:
            return len(conn.execute(sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = :app AND pid <> pg_backend_pid()"), {"app": app}
            ).all())

    for key in keys:
        broker.publish("orders", {"n": key}, key=key)
    consumer = Consumer(broker, handle, topics=["orders"], group="g", workers=4,
                        retry=POLICY, ack_timeout=0)
    killer = Killer(progress, kill)
    killer.start()
    try:
        consumer.run_until_idle(timeout=240)
    finally:
        killer.stopped.set()
        killer.join(5)
        consumer.stop(0)
        with engine.connect() as conn:
            rows = collections.Counter(r[0] for r in conn.execute(sa.select(effects.c.item)))
        checker.close()
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{effects.name}", "{dedup}"'))
        engine.dispose()
        admin.dispose()
    lost = [k for k in keys if rows[k] == 0]
    doubled = sum(max(n - 1, 0) for n in rows.values())
    report("pg_terminate_backend/TransactionalSqlChecker", N, killer.kills, len(lost), doubled)
    assert killer.kills >= 1
    assert lost == [] and doubled == 0
    assert broker.pending == 0 and broker.dead_letters == []


# -- Redis: CLIENT KILL of the broker's and the checker's connections ---------------------


def kill_named(admin: Any, names: set[str]) -> int:
    """CLIENT KILL every connection whose name is one of ``names`` (ours only)."""
    killed = 0
    for client in admin.client_list():
        if client.get("name") in names:
            with contextlib.suppress(Exception):  # already gone
                killed += int(admin.client_kill_filter(_id=client["id"]) or 0)
    return killed


@pytest.mark.redis
def test_redis_client_kill_broker_and_checker(unique: str, quiet: None,
                                              tmp_path: Path) -> None:
    import redis

    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    url = services.require("redis")
    names = {f"rel-broker-{unique}", f"rel-checker-{unique}"}
    broker_client = redis.Redis.from_url(url, client_name=f"rel-broker-{unique}")
    checker_client = redis.Redis.from_url(url, client_name=f"rel-checker-{unique}")
    admin = redis.Redis.from_url(url, client_name=f"rel-admin-{unique}")
    broker = RedisStreamsBroker(broker_client, visibility_timeout=2.0, claim_interval=0.2)
    checker = RedisChecker(checker_client, namespace=f"rel{unique}", ttl=600,
                           policy=STORE_POLICY)
    topic = f"rel-kill-{unique}"
    keys = [f"k{i}" for i in range(N)]
    progress = Progress(keys)

    @idempotent(checker, group="g")
    def handle(message: Message) -> None:
        progress.applied(str(message.key))

    for key in keys:
        broker.publish(topic, {"n": key}, key=key)
    consumer = Consumer(broker, handle, topics=[topic], group="g", workers=4,
                        retry=POLICY, ack_timeout=0, poll_timeout=0.1)
    killer = Killer(progress, lambda: kill_named(admin, names))
    consumer.start()
    killer.start()
    try:
        recovered = progress.all_done.wait(120)
    finally:
        killer.stopped.set()
        killer.join(5)
        consumer.stop(10)
        broker.close()
    report("redis CLIENT KILL broker+RedisChecker", N, killer.kills, len(progress.lost()),
           progress.doubled())
    pending = admin.xpending(topic, "g")["pending"]
    admin.delete(topic)
    checker.close()
    assert killer.kills >= 1
    assert recovered, f"consumer did not recover: {len(progress.lost())} messages unhandled"
    assert progress.lost() == []
    assert progress.doubled() == 0  # completions are retried: no lease window opened
    assert pending == 0


# -- a redis-server of our own, killed with SIGKILL and restarted ---------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedis:
    """A redis-server on a free port in a temp dir, with an fsync-always AOF so a
    SIGKILL loses nothing acknowledged."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port),
             "--bind", "127.0.0.1", "--dir", str(self.root), "--appendonly", "yes",
             "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        give_up = time.monotonic() + 10
        while time.monotonic() < give_up:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)  # waiting for a process we started to listen
        raise RuntimeError("own redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.mark.redis
def test_own_redis_server_sigkill_and_restart(tmp_path: Path, quiet: None) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    import redis

    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    server = OwnRedis(tmp_path)
    server.start()
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'fx.db'}", connect_args={"timeout": 30})
    effects = sa.Table("fx", sa.MetaData(), sa.Column("item", sa.String(32)))
    effects.create(engine)
    checker = TransactionalSqlChecker(engine, table="dd", policy=STORE_POLICY)
    broker = RedisStreamsBroker(redis.Redis.from_url(server.url), visibility_timeout=2.0,
                                claim_interval=0.2)
    keys = [f"k{i}" for i in range(N)]
    progress = Progress(keys)

    @idempotent(checker, group="g")
    def handle(message: Message, tx: sa.Connection) -> None:
        tx.execute(effects.insert().values(item=message.key))
        tx.info.setdefault("after_commit", []).append(message.key)

    sa.event.listen(engine, "commit", lambda conn: [
        progress.applied(k) for k in conn.info.pop("after_commit", [])])
    sa.event.listen(engine, "rollback", lambda conn: conn.info.pop("after_commit", None))

    for key in keys:
        broker.publish("orders", {"n": key}, key=key)

    def kill_and_restart() -> int:
        server.kill()
        server.start()
        return 1

    consumer = Consumer(broker, handle, topics=["orders"], group="g", workers=2,
                        retry=POLICY, ack_timeout=0, poll_timeout=0.1)
    killer = Killer(progress, kill_and_restart, most=3, every=250)
    consumer.start()
    killer.start()
    try:
        recovered = progress.all_done.wait(120)
    finally:
        killer.stopped.set()
        killer.join(15)
        consumer.stop(10)
        broker.close()
        with engine.connect() as conn:
            rows = collections.Counter(r[0] for r in conn.execute(sa.select(effects.c.item)))
        admin = redis.Redis.from_url(server.url)
        try:
            pending = admin.xpending("orders", "g")["pending"]
        finally:
            admin.close()
            server.kill()
        engine.dispose()
    lost = [k for k in keys if rows[k] == 0]
    doubled = sum(max(n - 1, 0) for n in rows.values())
    report("redis-server SIGKILL+restart/TransactionalSqlChecker", N, killer.kills,
           len(lost), doubled)
    assert killer.kills >= 1
    assert recovered, f"consumer did not recover: {len(progress.lost())} messages unhandled"
    assert lost == []
    assert doubled == 0
    assert pending == 0


# -- RabbitMQ: our connection closed server-side -----------------------------------------


def ready_drained(url: str, queue: str, consumer: Consumer, timeout: float) -> bool:
    """True once ``queue`` holds no message at all, ready or delivered and unacked (the
    adapter's prefetch buffer included), and the consumer holds none: polled with
    ``rabbitmqctl``, bounded by ``timeout``."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if consumer.in_flight == 0:
            counts = [line.split("\t") for line in rabbitmqctl(
                "list_queues", "name", "messages", "--no-table-headers").splitlines()]
            if all(int(n) == 0 for q, n in counts if q == queue):
                return True
        time.sleep(0.5)  # polling a server we get no events from
    return False


@pytest.mark.rabbitmq
def test_rabbitmq_connection_closed_server_side(unique: str, quiet: None,
                                                tmp_path: Path) -> None:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl not installed")
    from msgpatterns.brokers.rabbitmq import RabbitMQBroker

    url = services.require("rabbitmq")
    name = f"rel-rabbit-{unique}"
    broker = RabbitMQBroker(url, name=name, prefetch=50)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'fx.db'}", connect_args={"timeout": 30})
    effects = sa.Table("fx", sa.MetaData(), sa.Column("item", sa.String(32)))
    effects.create(engine)
    checker = TransactionalSqlChecker(engine, table="dd", policy=STORE_POLICY)
    topic = f"rel-rabbit-{unique}"
    keys = [f"k{i}" for i in range(N)]
    progress = Progress(keys)

    @idempotent(checker, group="g")
    def handle(message: Message, tx: sa.Connection) -> None:
        tx.execute(effects.insert().values(item=message.key))
        tx.info.setdefault("after_commit", []).append(message.key)

    sa.event.listen(engine, "commit", lambda conn: [
        progress.applied(k) for k in conn.info.pop("after_commit", [])])
    sa.event.listen(engine, "rollback", lambda conn: conn.info.pop("after_commit", None))

    broker.subscribe(topic, "g")  # the queue exists before the first publish
    for key in keys:
        broker.publish(topic, {"n": key}, key=key)
    consumer = Consumer(broker, handle, topics=[topic], group="g", workers=2,
                        retry=POLICY, ack_timeout=0, poll_timeout=0.1)
    consumer.start()
    killer = Killer(progress, lambda: close_rabbit_connections(name), most=3, every=250)
    try:
        killer.start()
        recovered = progress.all_done.wait(180)
        killer.stopped.set()
        if killer.is_alive():
            killer.join(60)
        # Redeliveries of acked-but-unconfirmed messages (the closes requeue them) are
        # duplicates still on their way: let the consumer drain them (skipped, acked).
        drained = recovered and ready_drained(url, f"{topic}.g", consumer, timeout=60)
    finally:
        killer.stopped.set()
        if killer.is_alive():
            killer.join(60)
        consumer.stop(10)
        broker.close()
        with engine.connect() as conn:
            rows = collections.Counter(r[0] for r in conn.execute(sa.select(effects.c.item)))
        engine.dispose()
    lost = [k for k in keys if rows[k] == 0]
    doubled = sum(max(n - 1, 0) for n in rows.values())
    report("rabbitmq close_connection/TransactionalSqlChecker", N, killer.kills, len(lost),
           doubled)
    queues = rabbitmqctl("list_queues", "name", "messages", "--no-table-headers")
    left = [line for line in queues.splitlines() if line.startswith(f"{topic}.g\t")]
    for line in left:
        rabbitmqctl("delete_queue", line.split("\t")[0])
    assert killer.kills >= 1
    assert recovered, f"consumer did not recover: {len(progress.lost())} messages unhandled"
    assert lost == []
    assert doubled == 0
    assert drained, "redelivered duplicates were never drained"
    assert all(line.split("\t")[1].strip() == "0" for line in left), left
