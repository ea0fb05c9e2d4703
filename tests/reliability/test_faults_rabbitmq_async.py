"""AsyncRabbitMQBroker + AsyncConsumer under faults, on the real RabbitMQ and PostgreSQL
(issue 19, holes 2 and 3, and the fault matrix lines for asyncio RabbitMQ).

Every handler is ``@idempotent`` on an :class:`AsyncTransactionalSqlChecker` writing its
effect row in the checker's transaction, so effects are exactly once whatever is
redelivered: lost and doubled are counted in the database. Faults hit only this test's
own connections: ``rabbitmqctl close_connection`` of the consumer's named connection,
or a :class:`~tcp_fault_proxy.FaultProxy` between the consumer and the server. Each
test then checks that the consumer recovered by itself and that nothing is stranded
(the group's queue holds no message, ready or unacked, once the run drained).
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from reliability_harness import record_fault
from server_faults import (
    close_rabbit_connections,
    quiet,
    rabbit_queue_depth,
    rabbitmqctl,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from msgpatterns import Message, Reject
from msgpatterns.aio import AsyncConsumer
from msgpatterns.idempotency import AsyncTransactionalSqlChecker, idempotent
from msgpatterns.retry import Backoff, RetryPolicy
from msgpatterns.testing import services
from tcp_fault_proxy import FaultProxy

__all__ = ["quiet"]  # a fixture, used by name

pytestmark = [pytest.mark.anyio, pytest.mark.rabbitmq, pytest.mark.postgres,
              pytest.mark.timeout(600)]

pytest.importorskip("aio_pika")

POLICY = RetryPolicy(max_attempts=50, backoff=Backoff.fixed(0.05), local_retries=0)
RECOVER = 120.0  # generous: CI is loaded, and rabbitmqctl takes seconds per call


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def report(name: str, messages: int, faults: int, lost: int, doubled: int, *,
           stranded: int, recover: float | None) -> None:
    """One line of the reliability summary, with stranded and seconds to recover."""
    record_fault(f"fault: rabbitmq-async {name}", messages, faults, lost, doubled,
                 stranded=stranded, recover=recover)
    print(f"rabbitmq-async {name}: messages={messages} faults={faults} lost={lost} "
          f"doubled={doubled} stranded={stranded} recover_s="
          f"{'-' if recover is None else f'{recover:.2f}'}")


# -- rabbitmqctl: our own connections and queues only -------------------------------------


def delete_queues(prefix: str) -> None:
    for line in rabbitmqctl("list_queues", "name", "--no-table-headers").splitlines():
        if line.strip().startswith(prefix):
            subprocess.run(["rabbitmqctl", "-q", "delete_queue", line.strip()],
                           capture_output=True, timeout=60, check=False)


# -- the workload ----------------------------------------------------------------------------


@dataclass
class Run:
    """One consumer run: its names, effects table and checker, and the progress."""

    rabbit: str
    postgres: str
    topic: str
    name: str  # the consumer's connection name
    queue_type: str = "quorum"
    keys: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)  # keys whose handler returned
    applied: collections.Counter[str] = field(default_factory=collections.Counter)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    engine: sa.Engine | None = None
    effects: sa.Table | None = None
    checker: AsyncTransactionalSqlChecker | None = None

    @property
    def queue(self) -> str:
        return f"{self.topic}.g"

    async def until(self, count: int, timeout: float) -> bool:
        """Wait (events) until ``count`` keys are done."""
        give_up = time.monotonic() + timeout
        while len(self.done) < count:
            self.changed.clear()
            left = give_up - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return len(self.done) >= count
        return True

    def rows(self) -> collections.Counter[str]:
        assert self.engine is not None and self.effects is not None
        with self.engine.connect() as conn:
            return collections.Counter(conn.scalars(sa.select(self.effects.c.item)))

    async def drained(self, consumer: AsyncConsumer, timeout: float = 60.0) -> int:
        """Messages left in the group's queue once the consumer holds none, polled with
        rabbitmqctl (a server we get no events from) up to ``timeout``: 0 when
        nothing is stranded."""
        give_up = time.monotonic() + timeout
        left = -1
        while time.monotonic() < give_up:
            if consumer.in_flight == 0:
                left = await asyncio.to_thread(rabbit_queue_depth, self.queue)
                if left == 0:
                    return 0
            await asyncio.sleep(0.5)
        return left if left >= 0 else await asyncio.to_thread(rabbit_queue_depth, self.queue)


@pytest.fixture
async def run(unique: str) -> AsyncIterator[Run]:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl not installed")
    r = Run(rabbit=services.require("rabbitmq"), postgres=services.require("postgres"),
            topic=f"arel-{unique}", name=f"arel-{unique}")
    r.engine = sa.create_engine(r.postgres, poolclass=sa.pool.NullPool)
    r.effects = sa.Table(f"arel_fx_{unique}", sa.MetaData(),
                         sa.Column("item", sa.String(40), nullable=False))
    r.effects.create(r.engine)
    r.checker = AsyncTransactionalSqlChecker(r.postgres, f"arel_dd_{unique}",
                                             namespace=f"n{unique}")
    try:
        yield r
    finally:
        await r.checker.aclose()
        with r.engine.begin() as conn:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{r.effects.name}", '
                                 f'"arel_dd_{unique}"'))
        r.engine.dispose()
        await asyncio.to_thread(delete_queues, r.topic)


def handler(run: Run, *, fail_once: Callable[[str], bool] = lambda key: False,
            reject: Callable[[str], bool] = lambda key: False,
            hold: asyncio.Event | None = None,
            slow: Callable[[str], float] = lambda key: 0.0,
            ) -> Callable[[Message], Awaitable[None]]:
    """The idempotent handler: writes the key's effect row in the checker's transaction."""
    assert run.checker is not None and run.effects is not None
    effects = run.effects
    failed: set[str] = set()

    @idempotent(run.checker, group="g")
    async def handle(message: Message, tx: AsyncConnection) -> None:
        key = str(message.key)
        if hold is not None:
            await hold.wait()
        if slow(key):
            await asyncio.sleep(slow(key))
        if reject(key):
            raise Reject("the order is invalid")
        if fail_once(key) and key not in failed:
            failed.add(key)
            raise RuntimeError("transient failure")
        await tx.execute(effects.insert().values(item=key))
        run.done.add(key)
        run.changed.set()

    return handle


def plain_handler(run: Run, *, hold: asyncio.Event | None = None
                  ) -> Callable[[Message], Awaitable[None]]:
    """A handler with no idempotency: its effects are counted in memory."""

    async def handle(message: Message) -> None:
        if hold is not None:
            await hold.wait()
        key = str(message.key)
        run.applied[key] += 1
        run.done.add(key)
        run.changed.set()

    return handle


async def publish(run: Run, count: int, start: int = 0) -> list[str]:
    """``count`` messages from a publisher of its own (never closed by the faults)."""
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

    keys = [f"k{i}" for i in range(start, start + count)]
    async with AsyncRabbitMQBroker(run.rabbit, queue_type=run.queue_type,
                                   name=f"{run.name}-pub") as publisher:
        await publisher.subscribe(run.topic, "g")
        for key in keys:
            await publisher.publish(run.topic, {"n": key}, key=key)
    run.keys += keys
    return keys


def consumer_broker(run: Run, url: str | None = None, **options: Any) -> Any:
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

    return AsyncRabbitMQBroker(url or run.rabbit, name=run.name, prefetch=50,
                               queue_type=run.queue_type, **options)


def outcome(run: Run, expected: list[str]) -> tuple[list[str], int]:
    rows = run.rows()
    lost = [k for k in expected if rows[k] == 0]
    return lost, sum(max(n - 1, 0) for n in rows.values())


# -- hole 2: two ack flushes at once closed the channel; consumption stopped silently ----


async def test_acks_of_a_busy_consumer_never_close_its_channel(run: Run, quiet: None
                                                                ) -> None:
    """The issue's scenario three times over: 600 orders, 50 in flight, every 10th
    failing once, one rejected, handlers of uneven speed: every order but the rejected
    one is applied exactly once, and the consumer keeps receiving (on main, 200 orders
    stalled at 50-194 of 199 in 4 of 6 runs; 2 of 3 here)."""
    keys = await publish(run, 600)
    rejected = "k7"
    expected = [k for k in keys if k != rejected]
    handle = handler(run, fail_once=lambda k: int(k[1:]) % 10 == 0,
                     reject=lambda k: k == rejected,
                     slow=lambda k: (int(k[1:]) * 7919 % 5) / 1000)
    broker = consumer_broker(run)
    consumer = AsyncConsumer(broker, handle, topics=[run.topic], group="g",
                             max_in_flight=50, retry=POLICY, ack_timeout=0)
    started = time.monotonic()
    await consumer.start()
    try:
        finished = await run.until(len(expected), RECOVER)
        stranded = await run.drained(consumer) if finished else -1
    finally:
        await consumer.stop(10)
        await broker.close()
    lost, doubled = outcome(run, expected)
    report(f"busy acks {len(keys)} orders/50 in flight ({run.queue_type})", len(keys), 0,
           len(lost), doubled, stranded=stranded, recover=time.monotonic() - started)
    assert finished, f"the consumer stopped receiving: {len(run.done)} of {len(expected)}"
    assert lost == [] and doubled == 0
    assert stranded == 0
    from msgpatterns.brokers import RabbitMQBroker
    with RabbitMQBroker(run.rabbit, queue_type=run.queue_type) as admin:
        assert [d.message.key for d in admin.list_dead_letters(run.topic, "g")] == [rejected]


# -- hole 3: a server-side close of the consumer's connection ---------------------------


CLOSES = [
    pytest.param(1, "classic", "transactional", id="x1-classic"),
    pytest.param(1, "quorum", "transactional", id="x1-quorum"),
    pytest.param(3, "classic", "transactional", id="x3-classic"),
    pytest.param(3, "quorum", "transactional", id="x3-quorum"),
    pytest.param(3, "quorum", "ordered", id="x3-quorum-ordered"),
    pytest.param(3, "quorum", "plain", id="x3-quorum-plain"),
]


@pytest.mark.parametrize(("closes", "queue_type", "kind"), CLOSES)
async def test_consumer_recovers_from_server_side_connection_closes(
        run: Run, quiet: None, closes: int, queue_type: str, kind: str) -> None:
    """``closes`` closes of the consumer's connection, each while 50 deliveries are in
    handlers (held there until the close landed, so their acks meet a dead channel):
    every message applied, nothing stranded (on main: never fetched again after the
    first close). Exactly once with the transactional checker (also in ordered mode);
    a plain handler applies at most what was in flight at each close twice (the
    documented at-least-once window: those deliveries are redelivered)."""
    run.queue_type = queue_type
    keys = await publish(run, 300)
    go = asyncio.Event()
    go.set()
    handle = plain_handler(run, hold=go) if kind == "plain" else handler(run, hold=go)
    broker = consumer_broker(run)
    consumer = AsyncConsumer(broker, handle, topics=[run.topic], group="g",
                             max_in_flight=50, retry=POLICY, ack_timeout=0,
                             ordered=kind == "ordered")
    recoveries: list[float] = []
    await consumer.start()
    try:
        for i in range(closes):
            assert await run.until((i + 1) * len(keys) // (closes + 1), RECOVER), \
                f"stalled at {len(run.done)} of {len(keys)} before close {i + 1}"
            go.clear()  # the handlers now running wait for the close
            assert await asyncio.to_thread(close_rabbit_connections, run.name) == 1
            before = len(run.done)
            closed_at = time.monotonic()
            go.set()
            if not await run.until(before + 51, RECOVER):  # more than what was held
                break
            recoveries.append(time.monotonic() - closed_at)
        finished = len(recoveries) == closes and await run.until(len(keys), RECOVER)
        stranded = await run.drained(consumer) if finished else -1
    finally:
        go.set()
        await consumer.stop(10)
        await broker.close()
    if kind == "plain":
        lost = [k for k in keys if run.applied[k] == 0]
        doubled = sum(max(n - 1, 0) for n in run.applied.values())
    else:
        lost, doubled = outcome(run, keys)
    report(f"close_connection x{closes} ({queue_type}, {kind})", len(keys), closes,
           len(lost), doubled, stranded=stranded, recover=max(recoveries, default=None))
    assert len(recoveries) == closes, f"did not recover after close {len(recoveries) + 1}"
    assert finished, f"stalled at {len(run.done)} of {len(keys)}"
    assert lost == []
    assert doubled <= (50 * closes if kind == "plain" else 0)
    assert stranded == 0


# -- through a TCP proxy: killed while idle, a reply lost on the wire --------------------


@pytest.fixture
def proxy(run: Run) -> Iterator[FaultProxy]:
    parts = urlsplit(run.rabbit)
    with FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as p:
        yield p


async def test_connection_killed_while_idle_is_reopened_by_the_next_fetch(
        run: Run, quiet: None, proxy: FaultProxy) -> None:
    """The consumer drained its queue and waits; its connection dies on the wire; new
    messages published afterwards are all consumed, once."""
    first = await publish(run, 100)
    broker = consumer_broker(run, proxy.url(run.rabbit))
    consumer = AsyncConsumer(broker, handler(run), topics=[run.topic], group="g",
                             max_in_flight=50, retry=POLICY, ack_timeout=0)
    await consumer.start()
    recover: float | None = None
    try:
        assert await run.until(len(first), RECOVER)
        assert await run.drained(consumer) == 0  # idle: nothing held, nothing queued
        assert proxy.kill_all() >= 1
        killed_at = time.monotonic()
        second = await publish(run, 100, start=100)
        finished = await run.until(len(first) + 1, RECOVER)
        if finished:
            recover = time.monotonic() - killed_at
            finished = await run.until(len(first) + len(second), RECOVER)
        stranded = await run.drained(consumer) if finished else -1
    finally:
        await consumer.stop(10)
        await broker.close()
    lost, doubled = outcome(run, run.keys)
    report("killed while idle (proxy)", len(run.keys), 1, len(lost), doubled,
           stranded=stranded, recover=recover)
    assert finished, f"stalled at {len(run.done)} of {len(run.keys)}"
    assert lost == [] and doubled == 0 and stranded == 0
    assert proxy.connections >= 2  # it connected again


async def test_a_reply_lost_on_the_wire_strands_nothing(run: Run, quiet: None,
                                                        proxy: FaultProxy) -> None:
    """Mid-run, the next bytes the server sends the consumer (deliveries) are dropped
    and the connection closed: what the server had sent is redelivered, every message
    applied once, nothing left on the queue."""
    keys = await publish(run, 300)
    go = asyncio.Event()
    go.set()
    broker = consumer_broker(run, proxy.url(run.rabbit))
    consumer = AsyncConsumer(broker, handler(run, hold=go), topics=[run.topic], group="g",
                             max_in_flight=50, retry=POLICY, ack_timeout=0)
    await consumer.start()
    recover: float | None = None
    try:
        assert await run.until(100, RECOVER)
        go.clear()  # in flight now (50 at most): their acks go out after the loss
        held = len(run.done) + 50
        proxy.lose_next_reply()
        lost_at = time.monotonic()
        go.set()  # their acks free prefetch slots: the server sends more, and it is lost
        assert await asyncio.to_thread(proxy.reply_lost.wait, RECOVER)
        finished = await run.until(held + 1, RECOVER)  # from the new connection
        if finished:
            recover = time.monotonic() - lost_at
            finished = await run.until(len(keys), RECOVER)
        stranded = await run.drained(consumer) if finished else -1
    finally:
        go.set()
        await consumer.stop(10)
        await broker.close()
    lost, doubled = outcome(run, keys)
    report("reply lost on the wire (proxy)", len(keys), 1, len(lost), doubled,
           stranded=stranded, recover=recover)
    assert finished, f"stalled at {len(run.done)} of {len(keys)}"
    assert lost == [] and doubled == 0 and stranded == 0


# -- the consume channel closed by the server, the connection alive ---------------------


async def test_consume_channel_closed_by_the_server_is_reopened(run: Run, quiet: None
                                                                ) -> None:
    """The server closes the consume channel (``PRECONDITION_FAILED - unknown delivery
    tag``, what the late single ack of hole 2 caused), its connection stays up: the
    channel is reopened and consumption resumes; every message applied once. The close
    is provoked with a bogus ack written on the delivery's own aiormq channel (there is
    no way left through the adapter to make one)."""
    keys = await publish(run, 200)
    broker = consumer_broker(run)
    inner = handler(run)
    provoked = asyncio.Event()

    async def handle(message: Message) -> None:
        if message.key == "k50" and not provoked.is_set():
            provoked.set()
            channel = message.receipt.incoming.channel  # type: ignore[attr-defined]
            await channel.basic_ack(10**9)  # the server closes this channel
        await inner(message)

    consumer = AsyncConsumer(broker, handle, topics=[run.topic], group="g",
                             max_in_flight=50, retry=POLICY, ack_timeout=0)
    await consumer.start()
    recover: float | None = None
    try:
        await asyncio.wait_for(provoked.wait(), RECOVER)
        closed_at = time.monotonic()
        finished = await run.until(len(run.done) + 51, RECOVER)  # past what was held
        if finished:
            recover = time.monotonic() - closed_at
            finished = await run.until(len(keys), RECOVER)
        stranded = await run.drained(consumer) if finished else -1
    finally:
        await consumer.stop(10)
        await broker.close()
    lost, doubled = outcome(run, keys)
    report("consume channel closed by the server", len(keys), 1, len(lost), doubled,
           stranded=stranded, recover=recover)
    assert finished, f"stalled at {len(run.done)} of {len(keys)}"
    assert lost == [] and doubled == 0 and stranded == 0


async def test_the_consumer_reconnects_after_the_server_was_unreachable_a_while(
        run: Run, quiet: None, proxy: FaultProxy) -> None:
    """The connection dies and the server stays unreachable for several reconnect
    attempts (the proxy closes every new connection): once it is back the consumer
    reconnects by itself (backoff between attempts, no error raised to the consumer)
    and finishes; every message applied once, nothing stranded."""
    keys = await publish(run, 200)
    go = asyncio.Event()
    go.set()
    broker = consumer_broker(run, proxy.url(run.rabbit))
    consumer = AsyncConsumer(broker, handler(run, hold=go), topics=[run.topic], group="g",
                             max_in_flight=50, retry=POLICY, ack_timeout=0)
    await consumer.start()
    recover: float | None = None
    try:
        assert await run.until(60, RECOVER)
        go.clear()
        proxy.down.set()
        assert proxy.kill_all() >= 1
        held = len(run.done) + 50
        go.set()
        assert await asyncio.to_thread(proxy.wait_refused, 3, RECOVER)  # attempts fail
        proxy.down.clear()
        back_at = time.monotonic()
        finished = await run.until(held + 1, RECOVER)
        if finished:
            recover = time.monotonic() - back_at
            finished = await run.until(len(keys), RECOVER)
        stranded = await run.drained(consumer) if finished else -1
    finally:
        proxy.down.clear()
        go.set()
        await consumer.stop(10)
        await broker.close()
    lost, doubled = outcome(run, keys)
    report("server unreachable for 3 attempts (proxy)", len(keys), 1, len(lost), doubled,
           stranded=stranded, recover=recover)
    assert finished, f"stalled at {len(run.done)} of {len(keys)}"
    assert lost == [] and doubled == 0 and stranded == 0
