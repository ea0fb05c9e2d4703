"""The fault matrix for the adapters the Redis and asyncio-RabbitMQ files do not cover
(issue 19, "The harness"): sync RabbitMQ, NATS JetStream (sync; asyncio through
:class:`~msgpatterns.aio.threaded.ThreadedAsyncBroker`, kind ``async``; and the native
:class:`~msgpatterns.aio.AsyncNatsJetStreamBroker`, kind ``native``) and Kafka on
librdkafka's mock cluster, each x {plain handler, ``@idempotent`` (batch claims, the default)} x the
faults that apply to it:

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
import contextlib
import ctypes
import glob
import inspect
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis_fault_tools import POLICY, Driver, Effects, quiet, with_client_name
from reliability_harness import record_fault
from server_faults import close_rabbit_connections, rabbit_queue_depth, race_stop_and_close

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
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    #: the consumer's broker as a native asyncio adapter (built on the driver's loop)
    make_async_broker: Callable[[], Any] | None = None


def rabbitmq_target(unique: str, proxy_faults: bool) -> Target:
    from msgpatterns.brokers import RabbitMQBroker

    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl not installed")
    url = services.require("rabbitmq")
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
        publisher.close()
        for queue in (f"{topic}.g",):
            subprocess.run(["rabbitmqctl", "-q", "delete_queue", queue],
                           capture_output=True, timeout=60, check=False)

    return Target(
        "rabbitmq", topic,
        make_broker=lambda: RabbitMQBroker(proxy.url(url) if proxy else url, name=name,
                                           prefetch=IN_FLIGHT),
        publish=publish, stranded=lambda: rabbit_queue_depth(f"{topic}.g"),
        server_close=lambda: close_rabbit_connections(name, "fault matrix: server-side close"),
        proxy=proxy,
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

    def __init__(self) -> None:
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
        self._cluster = lib.rd_kafka_mock_cluster_new(self._rk, 1)
        assert self._cluster, "rd_kafka_mock_cluster_new failed"
        self.bootstrap_servers: str = lib.rd_kafka_mock_cluster_bootstraps(
            self._cluster).decode()

    def down(self) -> None:
        assert self.lib.rd_kafka_mock_broker_set_down(self._cluster, 1) == 0

    def up(self) -> None:
        assert self.lib.rd_kafka_mock_broker_set_up(self._cluster, 1) == 0

    def close(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self._cluster)
        self.lib.rd_kafka_destroy(self._rk)


def kafka_target(unique: str) -> Target:
    """The "server-side close" is the mock broker down for a second, then up."""
    pytest.importorskip("confluent_kafka")
    import confluent_kafka

    from msgpatterns.brokers import KafkaBroker

    cluster = MockKafkaCluster()
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
        publish=publish, stranded=stranded, server_close=bounce, cleanup=[cleanup])


# -- the matrix -------------------------------------------------------------------------

FAULTS = ["server-close", "killed-while-idle", "lost-reply", "stop-close-race"]
ADAPTERS = [("rabbitmq", "sync"), ("nats", "sync"), ("nats", "async"), ("nats", "native"),
            ("kafka", "sync")]
MARKS = {"rabbitmq": pytest.mark.rabbitmq, "nats": pytest.mark.nats,
         "kafka": pytest.mark.kafka}

#: Combinations that meet a documented limit, not a bug (not strict: timing).
#: NATS: a delivery the server sent to a connection that died before it arrived (a
#: pull request answered during the reconnect) waits for ack_wait - JetStream does not
#: say which deliveries a lost pull request took (docs/brokers.md, "In transit at a
#: connection's death"); ack_wait here is longer than the test waits. Seen in 2 of 8
#: killed-while-idle runs (one delivery each) and when the lost reply carried
#: deliveries; the acks and close()'s hand-backs are confirmed and never strand anything
#: since issue 19 (the stop/close race lines are strict).
NATS_IN_TRANSIT = ("NATS: a delivery in transit to a connection that dies waits for "
                   "ack_wait (visibility_timeout); JetStream cannot say which it was")
KNOWN: dict[tuple[str, str, str, str], str] = {
    ("nats", kind, mode, fault): NATS_IN_TRANSIT
    for kind in ("sync", "async", "native") for mode in ("plain", "idempotent")
    for fault in ("killed-while-idle", "server-close", "lost-reply")
}


def combinations() -> Iterator[Any]:
    for adapter, kind in ADAPTERS:
        for mode in ("plain", "idempotent"):
            for fault in FAULTS:
                if adapter == "kafka" and fault == "lost-reply":
                    continue  # no proxy can sit between librdkafka and the mock cluster
                marks = [MARKS[adapter]]
                reason = KNOWN.get((adapter, kind, mode, fault))
                if reason:
                    marks.append(pytest.mark.xfail(strict=False, reason=reason))
                yield pytest.param(adapter, kind, mode, fault, marks=marks,
                                   id=f"{adapter}-{kind}-{mode}-{fault}")


def build_target(adapter: str, unique: str, fault: str) -> Target:
    if adapter == "rabbitmq":
        return rabbitmq_target(unique, proxy_faults=fault in ("killed-while-idle",
                                                              "lost-reply"))
    if adapter == "nats":
        return nats_target(unique)
    return kafka_target(unique)


@pytest.mark.parametrize(("adapter", "kind", "mode", "fault"), list(combinations()))
def test_adapter_fault_matrix(adapter: str, kind: str, mode: str, fault: str,
                              unique: str, quiet: None) -> None:
    """One line of the fault matrix: an adapter, a driver, a handler mode, a fault; 200
    messages; afterwards nothing lost, nothing stranded, nothing doubled behind
    ``@idempotent`` (but across a stop/close race, at most what was in flight)."""
    from msgpatterns.aio.threaded import ThreadedAsyncBroker
    from msgpatterns.idempotency import AsyncRedisChecker, MemoryChecker

    unique = uuid.uuid4().hex[:10]
    target = build_target(adapter, unique, fault)
    effects = Effects()
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

    def apply(message: Message) -> None:
        gate.wait(WAIT)
        effects.applied(message.raw_body.decode())

    brokers: list[Any] = []

    def build() -> Any:
        options: dict[str, Any] = {"retry": POLICY, "poll_timeout": 0.05,
                                   "ack_timeout": 0}
        make_async = target.make_async_broker
        native = kind == "native" and make_async is not None
        broker = make_async() if make_async is not None and native else target.make_broker()
        brokers.append(broker)
        if on_loop:
            async def handle_async(message: Message) -> None:
                if not gate.is_set():
                    await asyncio.to_thread(gate.wait, WAIT)
                apply(message)

            handler: Any = handle_async if checker is None \
                else idempotent(checker, group="g")(handle_async)
            face = broker if native else ThreadedAsyncBroker(broker)
            return AsyncConsumer(face, handler, topics=[target.topic],
                                 group="g", max_in_flight=IN_FLIGHT, **options)
        # (``is None``: an empty MemoryChecker is falsy, it has a length)
        handler = apply if checker is None else idempotent(checker, group="g")(apply)
        return Consumer(broker, handler, topics=[target.topic], group="g", workers=4,
                        max_in_flight=IN_FLIGHT, **options)

    def publish(first: int, count: int) -> None:
        target.publish([(f"m{i}", f"m{i}".encode()) for i in range(first, first + count)])

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
                elif not broker.closed:  # a native async adapter: on its loop
                    driver.call(broker.close)
        driver.finish()
        if target.proxy is not None:
            target.proxy.close()
        for cleanup in target.cleanup:
            with contextlib.suppress(Exception):
                cleanup()
        if checker is not None and on_loop:
            asyncio.run(checker.aclose())
    lost = sum(1 for i in range(N) if effects.count[f"m{i}"] == 0)
    doubled = effects.doubled()
    record_fault(f"fault: {adapter} {kind} {mode} {fault}", N, faults, lost, doubled,
                 stranded=stranded, recover=max(recoveries, default=None))
    print(f"fault: {adapter} {kind} {mode} {fault} messages={N} faults={faults} "
          f"lost={lost} doubled={doubled} stranded={stranded} recover_s="
          f"{max(recoveries, default=0.0):.2f} effects_s={effects_s:.2f} "
          f"seconds={seconds:.2f}")
    assert finished, f"stalled at {len(effects.count)} of {N}"
    assert lost == 0 and stranded == 0
    assert faults >= 1, "no fault was injected"
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
