"""The fault matrix for the adapters the Redis and asyncio-RabbitMQ files do not cover
(issue 19, "The harness"): sync RabbitMQ, NATS JetStream (sync; asyncio through
:class:`~msgpatterns.aio.threaded.ThreadedAsyncBroker`, kind ``async``; and the native
:class:`~msgpatterns.aio.AsyncNatsJetStreamBroker`, kind ``native``) and Kafka on
librdkafka's mock cluster, each x {plain handler, ``@idempotent`` (batch claims, the
default), explicit ack (``disable_auto_ack`` in the handler, ``ack()`` from another
thread once the effect is in), ordered (``ordered=True``, 20 keys: each key's messages
must be first applied in the order they were sent)} x the faults that apply to it:

* ``server-close``: the server ends the consumer's connection while messages flow
  (RabbitMQ: ``rabbitmqctl close_connection`` of this test's own named connection;
  NATS: every connection through this test's :class:`~tcp_fault_proxy.FaultProxy`
  killed; Kafka: the mock cluster's broker taken down, then up again);
* ``killed-while-idle``: the consumer drained a wave and waits; its connection dies on
  the wire (FaultProxy; Kafka: the broker down and up between waves);
* ``lost-reply``: the next bytes the server sends are dropped and the connection closed
  (FaultProxy's drop-reply mode; not for Kafka: the mock cluster's clients connect to the
  addresses it advertises, so no proxy sits in their way);
* ``stop-close-race``: the consumer's ``stop(timeout)`` and its broker's ``close()``
  from two threads while handlers run, twice; then a consumer that drains.
* ``server-killed`` (plain and ``@idempotent``, sync and asyncio): a server the test
  started itself dies with messages in flight - handlers running finish while it is
  down, so their acks fail - and comes back, twice. RabbitMQ: a private
  ``rabbitmq-server`` node (:class:`~server_faults.OwnRabbit`: own node name, ports,
  Mnesia directory) SIGKILLed and booted again on its data (asyncio: the native
  :class:`~msgpatterns.brokers.rabbitmq.aio.AsyncRabbitMQBroker`); Kafka: every broker
  of a 3-broker mock cluster down for ``KAFKA_OUTAGE`` seconds, then up (the mock
  cluster cannot be killed: it lives in the test's process and keeps its log and
  committed offsets in memory). NATS and Redis have their own (test_brokers_nats.py,
  test_reliability_faults.py).

One line per combination (messages, faults, lost, doubled, stranded, seconds):
``stranded`` is read on the broker side once the effects are all in, without waiting for
any visibility timeout (RabbitMQ: ready + unacked in the group's queue; NATS: the two
durable consumers' ``num_pending + num_ack_pending``; Kafka: end offset minus the
group's committed offset, per partition). Lost 0 and stranded 0 everywhere; doubled 0
behind ``@idempotent`` except across a stop/close race (a stop whose deadline cuts a
claim round redelivers what was claimed: the documented lease window, bounded by what
was in flight).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import glob
import inspect
import os
import queue
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis_fault_tools import POLICY, Driver, Effects, quiet, with_client_name
from reliability_harness import record_fault
from server_faults import (
    OwnRabbit,
    close_rabbit_connections,
    rabbit_queue_depth,
    race_stop_and_close,
)

from msgpatterns import Consumer, idempotent
from msgpatterns.aio.consumer import AsyncConsumer
from msgpatterns.message import Message
from msgpatterns.testing import services
from tcp_fault_proxy import FaultProxy

pytestmark = [pytest.mark.timeout(300)]

__all__ = ["quiet"]  # a fixture, used by name

N = 200  # messages per combination
PER_WAVE = 50  # killed-while-idle: a fault after each wave but the last
IN_FLIGHT = 16  # the most deliveries a consumer holds (workers, max_in_flight)
WAIT = 60.0  # generous: CI is loaded
NATS_ACK_WAIT = 180.0  # the NATS durables' ack_wait: longer than WAIT


# -- the adapters ---------------------------------------------------------------------


@dataclass
class Target:
    """One adapter under test: how to build its consumer broker, publish, inject the
    server-side close, and count what is stranded."""

    name: str
    topic: str
    make_broker: Callable[[], Any]  # the consumer's broker (sync adapter)
    publish: Callable[[list[tuple[str, bytes]]], None]
    stranded: Callable[[], int]
    server_close: Callable[[], int]  # faults injected (0: none found)
    proxy: FaultProxy | None = None
    # server-killed: the server the test started, killed (SIGKILL; Kafka: every mock
    # broker down) and started again
    kill: Callable[[], None] | None = None
    restart: Callable[[], None] | None = None
    make_async_broker: Callable[[], Any] | None = None  # the asyncio adapter, if native
    cleanup: list[Callable[[], None]] = field(default_factory=list)


def rabbitmq_target(unique: str, proxy_faults: bool, own: OwnRabbit | None = None
                    ) -> Target:
    """On the shared server; or, for ``server-killed``, on ``own`` (a node the test
    started: SIGKILLed and booted again)."""
    from msgpatterns.brokers import RabbitMQBroker

    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl not installed")
    if own is not None:
        own.start()
    url = own.url if own is not None else services.require("rabbitmq")
    topic, name = f"fxm-{unique}", f"fxm-{unique}"
    parts = urlsplit(url)
    proxy = FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672) \
        if proxy_faults else None
    publisher = RabbitMQBroker(url, name=f"{name}-pub")
    publisher.subscribe(topic, "g")

    def publish(items: list[tuple[str, bytes]]) -> None:
        for key, body in items:
            publisher.publish(topic, body, key=key)

    def cleanup() -> None:
        with contextlib.suppress(Exception):
            publisher.close()
        if own is not None:
            own.kill()  # its data goes with the test's tmp_path
            return
        subprocess.run(["rabbitmqctl", "-q", "delete_queue", f"{topic}.g"],
                       capture_output=True, timeout=60, check=False)

    def make_async_broker() -> Any:
        from msgpatterns.brokers.rabbitmq.aio import AsyncRabbitMQBroker

        return AsyncRabbitMQBroker(url, name=name, prefetch=IN_FLIGHT)

    return Target(
        "rabbitmq", topic,
        make_broker=lambda: RabbitMQBroker(proxy.url(url) if proxy else url, name=name,
                                           prefetch=IN_FLIGHT),
        publish=publish,
        stranded=(lambda: own.queue_depth(f"{topic}.g")) if own is not None
        else (lambda: rabbit_queue_depth(f"{topic}.g")),
        server_close=lambda: close_rabbit_connections(name, "fault matrix: server-side close"),
        proxy=proxy,
        kill=own.kill if own is not None else None,
        restart=own.boot if own is not None else None,
        make_async_broker=make_async_broker,
        cleanup=[cleanup])


def nats_target(unique: str) -> Target:
    """Every consumer connection goes through a FaultProxy (its "server-side close" is
    the proxy killing them); the publisher and the inspector connect directly."""
    from msgpatterns.aio import AsyncNatsJetStreamBroker
    from msgpatterns.brokers import NatsJetStreamBroker

    url = services.require("nats")
    topic = f"fxm.{unique}"
    parts = urlsplit(url)
    proxy = FaultProxy(parts.hostname or "127.0.0.1", parts.port or 4222)
    # ack_wait longer than any wait of the test: what is only redelivered by ack_wait
    # shows as stranded (or stalled), never as a late success
    publisher = NatsJetStreamBroker(url, name=f"fxm-{unique}-pub",
                                    visibility_timeout=NATS_ACK_WAIT)
    publisher.subscribe(topic, "g")
    stream = NatsJetStreamBroker.stream_name(topic)

    def publish(items: list[tuple[str, bytes]]) -> None:
        for key, body in items:
            publisher.publish(topic, body, key=key)

    def stranded() -> int:
        import nats

        async def read() -> int:
            nc = await nats.connect(url, name=f"fxm-{unique}-inspect")
            try:
                js = nc.jetstream()
                total = 0
                for durable in ("g", "g__retry"):
                    info = await js.consumer_info(stream, durable)
                    total += int(info.num_pending or 0) + int(info.num_ack_pending or 0)
                return total
            finally:
                await nc.close()

        return asyncio.run(read())

    def cleanup() -> None:
        import nats

        async def drop() -> None:
            nc = await nats.connect(url)
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(stream)
            await nc.close()

        publisher.close()
        asyncio.run(drop())

    return Target(
        "nats", topic,
        make_broker=lambda: NatsJetStreamBroker(proxy.url(url), name=f"fxm-{unique}",
                                                visibility_timeout=NATS_ACK_WAIT),
        publish=publish, stranded=stranded, server_close=proxy.kill_all, proxy=proxy,
        cleanup=[cleanup],
        make_async_broker=lambda: AsyncNatsJetStreamBroker(
            proxy.url(url), name=f"fxm-{unique}", visibility_timeout=NATS_ACK_WAIT))


class MockKafkaCluster:
    """A librdkafka mock cluster made through librdkafka's C API (confluent-kafka does
    not expose ``rd_kafka_mock_*``), so that its broker can be taken down and up:
    ``rd_kafka_mock_broker_set_down`` closes its connections and refuses new ones."""

    def __init__(self, brokers: int = 1) -> None:
        import confluent_kafka

        libs = os.path.join(os.path.dirname(confluent_kafka.__file__), os.pardir,
                            "confluent_kafka.libs")
        found = glob.glob(os.path.join(libs, "librdkafka*.so*"))
        if not found:
            pytest.skip("confluent-kafka's bundled librdkafka not found (mock API needed)")
        lib = self.lib = ctypes.CDLL(found[0])
        lib.rd_kafka_conf_new.restype = ctypes.c_void_p
        lib.rd_kafka_new.restype = ctypes.c_void_p
        lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
                                     ctypes.c_size_t]
        lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
        lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
        for fn in (lib.rd_kafka_mock_broker_set_down, lib.rd_kafka_mock_broker_set_up):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
        error = ctypes.create_string_buffer(512)
        self._rk = lib.rd_kafka_new(0, lib.rd_kafka_conf_new(), error, 512)  # a producer
        assert self._rk, error.value
        self.brokers = brokers
        self._cluster = lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        assert self._cluster, "rd_kafka_mock_cluster_new failed"
        self.bootstrap_servers: str = lib.rd_kafka_mock_cluster_bootstraps(
            self._cluster).decode()

    def down(self, broker: int = 1) -> None:
        assert self.lib.rd_kafka_mock_broker_set_down(self._cluster, broker) == 0

    def up(self, broker: int = 1) -> None:
        assert self.lib.rd_kafka_mock_broker_set_up(self._cluster, broker) == 0

    def all_down(self) -> None:
        """Every broker of the cluster down: the closest the mock cluster comes to a
        killed server (it keeps its logs and committed offsets in memory, as a restarted
        broker keeps them on disk)."""
        for broker in range(1, self.brokers + 1):
            self.down(broker)

    def all_up(self) -> None:
        for broker in range(1, self.brokers + 1):
            self.up(broker)

    def close(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self._cluster)
        self.lib.rd_kafka_destroy(self._rk)


def kafka_target(unique: str, brokers: int = 1) -> Target:
    """The "server-side close" is the mock broker down for a second, then up; the
    "server-killed" (a cluster of ``brokers``) every broker down, then all up again."""
    pytest.importorskip("confluent_kafka")
    import confluent_kafka

    from msgpatterns.brokers import KafkaBroker

    cluster = MockKafkaCluster(brokers)
    topic = f"fxm-{unique}"
    quiet_log = {"log_level": 0}
    publisher = KafkaBroker(cluster.bootstrap_servers, producer_config=quiet_log)

    def publish(items: list[tuple[str, bytes]]) -> None:
        for key, body in items:
            publisher.publish(topic, body, key=key)

    def stranded() -> int:
        """End offset minus the group's committed offset, summed over partitions."""
        inspector = confluent_kafka.Consumer({
            "bootstrap.servers": cluster.bootstrap_servers, "group.id": "g",
            "enable.auto.commit": False, "log_level": 0})
        try:
            meta = inspector.list_topics(topic, timeout=10).topics[topic]
            parts = [confluent_kafka.TopicPartition(topic, p) for p in meta.partitions]
            total = 0
            for tp in inspector.committed(parts, timeout=10):
                _, high = inspector.get_watermark_offsets(tp, timeout=10)
                total += high - max(tp.offset, 0)
            return total
        finally:
            inspector.close()

    def bounce() -> int:
        cluster.down()
        time.sleep(1.0)  # the fault's length: down this long, whatever the client does
        cluster.up()
        return 1

    def restart() -> None:
        time.sleep(KAFKA_OUTAGE)  # the outage's length, whatever the client does
        cluster.all_up()

    def cleanup() -> None:
        publisher.close()
        cluster.close()

    return Target(
        "kafka", topic,
        # a short session: a member the faults cut off is replaced in seconds, not 45
        make_broker=lambda: KafkaBroker(cluster.bootstrap_servers,
                                        consumer_config={**quiet_log,
                                                         "session.timeout.ms": 6000,
                                                         "heartbeat.interval.ms": 500},
                                        producer_config=quiet_log),
        publish=publish, stranded=stranded, server_close=bounce,
        kill=cluster.all_down, restart=restart, cleanup=[cleanup])


# -- the matrix -------------------------------------------------------------------------

FAULTS = ["server-close", "killed-while-idle", "lost-reply", "stop-close-race",
          "server-killed"]
MODES = ["plain", "idempotent", "explicit-ack", "ordered"]
ADAPTERS = [("rabbitmq", "sync"), ("nats", "sync"), ("nats", "async"), ("nats", "native"),
            ("kafka", "sync")]
#: The asyncio adapters on a server the test kills (only that fault here: the other
#: faults of asyncio RabbitMQ are in test_faults_rabbitmq_async.py)
KILLED_ONLY = [("rabbitmq", "async"), ("kafka", "async")]
MARKS = {"rabbitmq": pytest.mark.rabbitmq, "nats": pytest.mark.nats,
         "kafka": pytest.mark.kafka}
KEYS = 20  # ordered lines: message m{i} has key k{i % KEYS}; elsewhere its own key
KAFKA_OUTAGE = 3.0  # server-killed: seconds every mock broker stays down

#: Combinations that meet a documented limit, not a bug (not strict: timing).
#: NATS: a delivery the server sent to a connection that died before it arrived (a
#: pull request answered during the reconnect) waits for ack_wait - JetStream does not
#: say which deliveries a lost pull request took (docs/brokers.md, "In transit at a
#: connection's death"); ack_wait here is longer than the test waits. Seen in 2 of 8
#: killed-while-idle runs (one delivery each) and when the lost reply carried
#: deliveries; the acks and close()'s hand-backs are confirmed and never strand anything
#: since issue 19 (the stop/close race lines are strict). On an ordered line the same
#: delivery also holds its key until ack_wait.
NATS_IN_TRANSIT = ("NATS: a delivery in transit to a connection that dies waits for "
                   "ack_wait (visibility_timeout); JetStream cannot say which it was")
KNOWN: dict[tuple[str, str, str, str], str] = {
    ("nats", kind, mode, fault): NATS_IN_TRANSIT
    for kind in ("sync", "async", "native") for mode in MODES
    for fault in ("killed-while-idle", "server-close", "lost-reply")
}
#: RabbitMQ, ordered, across a stop/close race: 13-32 of 200 messages were first
#: applied before an earlier message of their key (on main's consumer too). The raced
#: consumer's unsettled deliveries go back to the quorum queue one ``basic_nack`` at a
#: time (stop's hand-backs, close()'s prefetched ones) and the rest when the channel
#: closes; a quorum queue redelivers returned messages in the order they came back,
#: not their original order, so a later message of a key can come back first.
#: Sync RabbitMQ on a node killed and booted again: in about half the runs the adapter's
#: I/O thread reconnects and then waits forever in pika's ``basic_consume`` for a
#: ``consume-ok`` the restarting node never sends (the quorum queue not yet recovered;
#: seen after ``ConnectionClosedByBroker: (541) 'INTERNAL_ERROR'`` on the attempt
#: before); a BlockingChannel RPC has no timeout, so the consumer never fetches again
#: (stack: _io.py _reconnect -> broker.py _consume -> basic_consume -> _flush_output).
#: The asyncio adapter (aio-pika, RPC timeouts) recovers in the same runs.
#: The asyncio adapter: no recovery within WAIT after the first restart in 3 of 6
#: runs (plain and @idempotent; not diagnosed yet). NOT_RUN: xfail lines not run at all
#: (a hang costs about two minutes of CI each time; take them out once fixed) - all
#: but asyncio/plain, which keeps one RabbitMQ kill-and-restart line running.
NOT_RUN: set[tuple[str, str, str, str]] = set()
for _mode in ("plain", "idempotent"):
    KNOWN[("rabbitmq", "sync", _mode, "server-killed")] = (
        "sync RabbitMQ: the reconnect after a node restart can hang forever in "
        "basic_consume (no RPC timeout in pika's BlockingChannel)")
    NOT_RUN.add(("rabbitmq", "sync", _mode, "server-killed"))
    KNOWN[("rabbitmq", "async", _mode, "server-killed")] = (
        "asyncio RabbitMQ: no recovery within WAIT after a node restart in 3 of 6 runs "
        "(not diagnosed)")
NOT_RUN.add(("rabbitmq", "async", "idempotent", "server-killed"))
KNOWN[("rabbitmq", "sync", "ordered", "stop-close-race")] = (
    "RabbitMQ quorum queue: deliveries handed back across a stop/close race return "
    "in hand-back order, not publish order; a key's later message can run first")


def applies(adapter: str, kind: str, mode: str, fault: str) -> bool:
    if adapter == "kafka" and fault == "lost-reply":
        return False  # no proxy can sit between librdkafka and the mock cluster
    if fault == "server-killed":
        # NATS and Redis have theirs (test_brokers_nats.py,
        # test_reliability_faults.py); the handler modes that settle differently
        return adapter != "nats" and mode in ("plain", "idempotent")
    if mode in ("explicit-ack", "ordered"):
        # (runtime) killed-while-idle meets no settlement in flight, as for a plain
        # handler; asyncio NATS is the same adapter behind ThreadedAsyncBroker
        return fault != "killed-while-idle" and (adapter, kind) not in (
            ("nats", "async"), ("nats", "native"))
    return True


def combinations() -> Iterator[Any]:
    lines = [(adapter, kind, mode, fault) for adapter, kind in ADAPTERS
             for mode in MODES for fault in FAULTS if applies(adapter, kind, mode, fault)]
    lines += [(adapter, kind, mode, "server-killed") for adapter, kind in KILLED_ONLY
              for mode in ("plain", "idempotent")]
    for adapter, kind, mode, fault in lines:
        marks = [MARKS[adapter]]
        reason = KNOWN.get((adapter, kind, mode, fault))
        if reason:
            marks.append(pytest.mark.xfail(
                strict=False, reason=reason,
                run=(adapter, kind, mode, fault) not in NOT_RUN))
        yield pytest.param(adapter, kind, mode, fault, marks=marks,
                           id=f"{adapter}-{kind}-{mode}-{fault}")


def build_target(adapter: str, unique: str, fault: str, root: Path) -> Target:
    killed = fault == "server-killed"
    if adapter == "rabbitmq":
        return rabbitmq_target(unique, proxy_faults=fault in ("killed-while-idle",
                                                              "lost-reply"),
                               own=OwnRabbit(root / "rabbit", f"fxm{unique}") if killed
                               else None)
    if adapter == "nats":
        return nats_target(unique)
    return kafka_target(unique, brokers=3 if killed else 1)


def out_of_order(order: dict[str, list[int]]) -> int:
    """Messages applied for the first time before an earlier message of their key had
    been (redeliveries of what was already applied may come again later: at least
    once)."""
    wrong = 0
    for indexes in order.values():
        seen: set[int] = set()
        last = -1
        for i in indexes:
            if i in seen:
                continue
            seen.add(i)
            if i < last:
                wrong += 1
            last = max(last, i)
    return wrong


@pytest.mark.parametrize(("adapter", "kind", "mode", "fault"), list(combinations()))
def test_adapter_fault_matrix(adapter: str, kind: str, mode: str, fault: str,
                              tmp_path: Path, quiet: None) -> None:
    """One line of the fault matrix: an adapter, a driver, a handler mode, a fault; 200
    messages; afterwards nothing lost, nothing stranded, nothing doubled behind
    ``@idempotent`` (but across a stop/close race, at most what was in flight), and on
    an ordered line each key's messages first applied in the order they were sent."""
    from msgpatterns.aio.threaded import ThreadedAsyncBroker
    from msgpatterns.idempotency import AsyncRedisChecker, MemoryChecker

    unique = uuid.uuid4().hex[:10]
    target = build_target(adapter, unique, fault, tmp_path)
    effects = Effects()
    order: dict[str, list[int]] = collections.defaultdict(list)  # key -> indexes applied
    checker: Any = None
    on_loop = kind in ("async", "native")  # an AsyncConsumer on the driver's loop
    if mode == "idempotent":
        if on_loop:
            checker = AsyncRedisChecker(
                with_client_name(services.require("redis"), f"fxm-{unique}"),
                namespace=f"fxm-{unique}", ttl=600)
        else:
            checker = MemoryChecker()

    gate = threading.Event()  # cleared: handlers wait (so a fault meets them running)
    gate.set()
    # explicit ack: the handler disables auto ack; another thread acks once the effect
    # is in (what a flusher does)
    to_ack: queue.SimpleQueue[Message | None] = queue.SimpleQueue()

    def acker() -> None:
        while (message := to_ack.get()) is not None:
            with contextlib.suppress(Exception):  # its consumer stopped: redelivered
                message.ack()

    acking = threading.Thread(target=acker, name="fxm-acker", daemon=True)
    acking.start()

    def apply(message: Message) -> None:
        if mode == "explicit-ack":
            message.disable_auto_ack()
        gate.wait(WAIT)
        body = message.raw_body.decode()
        with effects.cond:
            order[str(message.key)].append(int(body[1:]))
        effects.applied(body)
        if mode == "explicit-ack":
            to_ack.put(message)

    brokers: list[Any] = []

    def build() -> Any:
        options: dict[str, Any] = {"retry": POLICY, "poll_timeout": 0.05,
                                   "ack_timeout": 0, "ordered": mode == "ordered"}
        if on_loop:
            async def handle_async(message: Message) -> None:
                if not gate.is_set():
                    await asyncio.to_thread(gate.wait, WAIT)
                apply(message)

            handler: Any = handle_async if checker is None \
                else idempotent(checker, group="g")(handle_async)
            if adapter == "rabbitmq" or kind == "native":  # a native asyncio adapter
                assert target.make_async_broker is not None
                broker: Any = target.make_async_broker()
                brokers.append(broker)
            else:
                brokers.append(target.make_broker())
                broker = ThreadedAsyncBroker(brokers[-1])
            return AsyncConsumer(broker, handler, topics=[target.topic],
                                 group="g", max_in_flight=IN_FLIGHT, **options)
        # (``is None``: an empty MemoryChecker is falsy, it has a length)
        handler = apply if checker is None else idempotent(checker, group="g")(apply)
        broker = target.make_broker()
        brokers.append(broker)
        return Consumer(broker, handler, topics=[target.topic], group="g", workers=4,
                        max_in_flight=IN_FLIGHT, **options)

    def publish(first: int, count: int) -> None:
        target.publish([(f"k{i % KEYS}" if mode == "ordered" else f"m{i}",
                         f"m{i}".encode()) for i in range(first, first + count)])

    def all_in(count: int) -> bool:
        return effects.wait_for(lambda: len(effects.count) >= count, WAIT)

    driver = Driver("async" if on_loop else "sync")
    faults = 0
    recoveries: list[float] = []
    began = faulted_at = time.monotonic()
    try:
        if fault == "killed-while-idle":  # waves; the fault when a wave is done
            driver.start(build)
            for wave in range(N // PER_WAVE):
                publish(wave * PER_WAVE, PER_WAVE)
                assert all_in((wave + 1) * PER_WAVE), \
                    f"stalled at {len(effects.count)} in wave {wave}"
                if wave:
                    recoveries.append(time.monotonic() - faulted_at)
                if wave < N // PER_WAVE - 1:
                    wait_drained(target, 20)  # idle: acks reached the server
                    if target.proxy is not None:
                        faults += min(target.proxy.kill_all(), 1)
                    else:
                        faults += target.server_close()
                    faulted_at = time.monotonic()
        elif fault == "stop-close-race":  # two raced rounds, then a consumer that drains
            publish(0, N)
            for _ in range(2):
                driver = Driver("async" if on_loop else "sync")
                driver.start(build)
                before = sum(effects.count.values())
                effects.wait_for(lambda b=before: sum(effects.count.values()) >= b + 20,
                                 WAIT)
                race_stop_and_close(driver, brokers[-1])
                driver.finish()
                faults += 1
            driver = Driver("async" if on_loop else "sync")
            driver.start(build)
        else:
            publish(0, N)
            driver.start(build)
            for step in (1, 2):  # twice, while handlers run
                assert effects.wait_for(lambda s=step: len(effects.count) >= s * N // 3,
                                        WAIT), f"stalled at {len(effects.count)}"
                gate.clear()  # the handlers running now finish after the fault
                at = len(effects.count)
                faulted_at = time.monotonic()
                if fault == "lost-reply":
                    assert target.proxy is not None
                    target.proxy.lose_next_reply()
                    gate.set()  # their acks go out; the server's next bytes are lost
                    if target.proxy.reply_lost.wait(WAIT):
                        faults += 1
                elif fault == "server-killed":
                    assert target.kill is not None and target.restart is not None
                    target.kill()
                    gate.set()  # they finish while the server is down: acks fail
                    target.restart()
                    faults += 1
                    goal = min(at + 2 * IN_FLIGHT + 1, N)
                    assert effects.wait_for(lambda g=goal: len(effects.count) >= g,
                                            WAIT), \
                        f"no recovery after restart {faults}: {len(effects.count)} of {N}"
                else:
                    faults += min(target.server_close(), 1)
                    gate.set()
                # past what the consumer held (prefetched and running): from the new
                # connection
                goal = min(at + 2 * IN_FLIGHT + 1, N)
                if effects.wait_for(lambda g=goal: len(effects.count) >= g, WAIT):
                    recoveries.append(time.monotonic() - faulted_at)
        finished = all_in(N)
        effects_s = time.monotonic() - began
        stranded = wait_drained(target, 10)
        seconds = time.monotonic() - began
    finally:
        gate.set()
        with contextlib.suppress(Exception):
            driver.stop()
        for broker in brokers:
            with contextlib.suppress(Exception):
                if not inspect.iscoroutinefunction(broker.close):
                    broker.close()
                elif not getattr(broker, "closed", False):  # a native adapter: its loop
                    driver.call(broker.close)
        driver.finish()
        to_ack.put(None)
        acking.join(30)
        if target.proxy is not None:
            target.proxy.close()
        for cleanup in target.cleanup:
            with contextlib.suppress(Exception):
                cleanup()
        if checker is not None and on_loop:
            asyncio.run(checker.aclose())
    lost = sum(1 for i in range(N) if effects.count[f"m{i}"] == 0)
    doubled = effects.doubled()
    disorder = out_of_order(order) if mode == "ordered" else 0
    record_fault(f"fault: {adapter} {kind} {mode} {fault}", N, faults, lost, doubled,
                 stranded=stranded, recover=max(recoveries, default=None))
    print(f"fault: {adapter} {kind} {mode} {fault} messages={N} faults={faults} "
          f"lost={lost} doubled={doubled} stranded={stranded} recover_s="
          f"{max(recoveries, default=0.0):.2f} effects_s={effects_s:.2f} "
          f"seconds={seconds:.2f}" + (f" out_of_order={disorder}"
                                      if mode == "ordered" else ""))
    assert finished, f"stalled at {len(effects.count)} of {N}"
    assert lost == 0 and stranded == 0
    assert faults >= 1, "no fault was injected"
    assert disorder == 0, f"{disorder} messages applied before an earlier one of their key"
    if fault == "server-killed":
        assert len(recoveries) == faults, "no progress after a restart within WAIT"
    if mode == "idempotent":
        if fault == "stop-close-race":
            # a stop whose deadline cuts a claim round hands the claimed deliveries
            # back; the next consumer applies those again (the lease window): at most
            # what the raced consumers held
            assert doubled <= IN_FLIGHT * faults
        else:
            assert doubled == 0


def wait_drained(target: Target, timeout: float) -> int:
    """What is still pending on the broker side, polled until 0 or ``timeout`` (acks
    are sent without waiting, so they reach the server a moment after the effect)."""
    give_up = time.monotonic() + timeout
    while True:
        left = target.stranded()
        if left == 0 or time.monotonic() >= give_up:
            return left
        time.sleep(0.25)
