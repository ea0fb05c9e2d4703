"""Per-broker harnesses for the conformance suite and the adapter tests.

A harness hands out broker objects for one topic and group on one server (a new object
is a restarted consumer), simulates a consumer's death, and reads the dead letters.
Service harnesses skip (or fail, under MSGPATTERNS_REQUIRE_SERVICES=1) when their server
or client library is missing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from msgpatterns.brokers.base import Broker
from msgpatterns.brokers.memory import InMemoryBroker
from msgpatterns.deadletter import DeadLetter
from msgpatterns.message import Message
from msgpatterns.testing import services


def eventually(predicate: Callable[[], Any], timeout: float = 15.0, every: float = 0.02,
               message: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    give_up = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"{message} not reached within {timeout}s")
        time.sleep(every)


def drain(broker: Broker, topic: str, group: str, *, count: int | None = None,
          within: float = 10.0, batch: int = 10) -> list[Message]:
    """Fetch until ``count`` deliveries arrived (or, with ``count=None``, for the whole
    ``within`` seconds); returns what arrived."""
    got: list[Message] = []
    give_up = time.monotonic() + within
    while count is None or len(got) < count:
        left = give_up - time.monotonic()
        if left <= 0:
            break
        want = batch if count is None else min(batch, count - len(got))
        got.extend(broker.fetch([topic], group, max_messages=want, timeout=min(left, 0.1)))
    return got


def require_library(module: str, what: str) -> None:
    """Skip when ``module`` cannot be imported (fail under MSGPATTERNS_REQUIRE_SERVICES)."""
    try:
        __import__(module)
    except ImportError as exc:
        reason = f"{what} needs {module}: {exc}"
        if services.services_required():
            pytest.fail(f"MSGPATTERNS_REQUIRE_SERVICES=1 but {reason}", pytrace=False)
        pytest.skip(reason)


def sigkill_while_holding(broker_code: str, topic: str, group: str, count: int) -> None:
    """Run a child process that builds a broker (``broker_code`` is an expression),
    fetches ``count`` deliveries of ``topic`` for ``group`` and holds them; SIGKILL it
    while it holds them. Returns once it is dead."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from msgpatterns.brokers import *
            broker = {broker_code}
            got = []
            while len(got) < {count}:
                got += broker.fetch([{topic!r}], {group!r}, max_messages={count},
                                    timeout=1)
            print("holding", len(got), flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == f"holding {count}"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


class Harness:
    """One broker kind, one topic and group on one server."""

    name = "?"
    #: Whether a redelivery after a consumer crash counts as an attempt.
    counts_crash_redeliveries = True
    #: Seconds within which a dead consumer's deliveries reach another consumer.
    crash_window = 5.0
    #: Seconds to watch for a redelivery that must not happen.
    quiet = 1.0

    def __init__(self, unique: str) -> None:
        self.topic = f"conf-{unique}"
        self.group = f"group-{unique}"
        self._brokers: list[Any] = []

    def broker(self) -> Broker:
        """A new broker object on the same server (a restarted consumer process)."""
        broker: Broker = self._make()
        self._brokers.append(broker)
        if hasattr(broker, "subscribe"):
            broker.subscribe(self.topic, self.group)
        return broker

    def _make(self) -> Any:
        raise NotImplementedError

    def crash(self, broker: Broker) -> None:
        """The process holding ``broker`` dies: no ack, no goodbye."""

    def close(self, broker: Broker) -> None:
        """A graceful shutdown of ``broker``."""
        broker.close()  # type: ignore[attr-defined]

    def dead_letters(self, broker: Broker) -> list[DeadLetter]:
        return broker.list_dead_letters(self.topic, self.group)  # type: ignore[attr-defined,no-any-return]

    def cleanup(self) -> None:
        for broker in self._brokers:
            with contextlib.suppress(Exception):
                broker.close()


class MemoryHarness(Harness):
    name = "memory"
    quiet = 0.2

    def __init__(self, unique: str) -> None:
        super().__init__(unique)
        self.shared = InMemoryBroker(visibility_timeout=30.0)

    def _make(self) -> Any:
        return self.shared  # one process, one broker: a "restart" reuses it

    def crash(self, broker: Broker) -> None:
        self.shared.advance(31.0)  # past the visibility timeout (virtual clock)

    def close(self, broker: Broker) -> None:
        pass  # closing the fake ends it for everyone

    def dead_letters(self, broker: Broker) -> list[DeadLetter]:
        return self.shared.dead_letters

    def cleanup(self) -> None:
        self.shared.close()


class RedisHarness(Harness):
    name = "redis"
    crash_window = 5.0
    quiet = 1.5  # visibility timeout plus a claim interval

    def __init__(self, unique: str) -> None:
        require_library("redis", "RedisStreamsBroker")
        super().__init__(unique)
        import redis

        self.url = services.require("redis")
        self.client = redis.Redis.from_url(self.url)

    def _make(self) -> Any:
        from msgpatterns.brokers import RedisStreamsBroker

        return RedisStreamsBroker(self.client, visibility_timeout=1.0, claim_interval=0.1)

    def cleanup(self) -> None:
        super().cleanup()
        keys = list(self.client.scan_iter(match=f"{self.topic}*"))
        if keys:
            self.client.delete(*keys)
        self.client.close()


class RabbitMQHarness(Harness):
    name = "rabbitmq"
    crash_window = 3.0
    quiet = 0.5  # unacked deliveries go back the moment their connection closes

    def __init__(self, unique: str) -> None:
        require_library("pika", "RabbitMQBroker")
        super().__init__(unique)
        self.url = services.require("rabbitmq")

    def _make(self) -> Any:
        from msgpatterns.brokers import RabbitMQBroker

        return RabbitMQBroker(self.url, prefetch=50)

    def crash(self, broker: Broker) -> None:
        kill_rabbitmq_connection(broker)

    def cleanup(self) -> None:
        super().cleanup()
        delete_rabbitmq_topology(self.url, self.topic, self.group)


def kill_rabbitmq_connection(broker: Any) -> None:
    """The process dies: its I/O thread stops without a goodbye and the TCP connection
    drops under the server (which then requeues the unacked deliveries)."""
    import socket

    broker._shutdown = lambda: None  # no graceful close, no requeue of the buffer
    broker._reconnect = lambda: None
    broker._closed.set()
    broker._conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)
    broker._thread.join(5)


def delete_rabbitmq_topology(url: str, topic: str, group: str) -> None:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        queue = f"{topic}.{group}"
        for name in (queue, f"{queue}.dlq"):
            channel.queue_delete(name)
        channel.exchange_delete(topic)
    finally:
        conn.close()


_kafka_cluster: Any = None


def kafka_cluster() -> Any:
    """The process's librdkafka mock cluster (started on first use)."""
    global _kafka_cluster
    require_library("confluent_kafka", "KafkaBroker")
    if _kafka_cluster is None:
        from msgpatterns.testing.kafka_mock import KafkaMockCluster

        _kafka_cluster = KafkaMockCluster()
    return _kafka_cluster


#: Consumer settings for tests: the next-generation group protocol (KIP-848) joins a
#: mock-cluster group at once (the classic one waits 3 s per new group), topics are
#: auto-created, and fetches return quickly.
KAFKA_TEST_CONSUMER = {
    "group.protocol": "consumer",
    "allow.auto.create.topics": True,
    "fetch.wait.max.ms": 50,
}


class KafkaHarness(Harness):
    name = "kafka"
    counts_crash_redeliveries = False  # Kafka keeps no delivery count
    crash_window = 5.0
    quiet = 2.0

    def __init__(self, unique: str) -> None:
        self.cluster = kafka_cluster()
        super().__init__(unique)

    @property
    def url(self) -> str:
        return str(self.cluster.url)

    def _make(self) -> Any:
        from msgpatterns.brokers import KafkaBroker

        return KafkaBroker(self.cluster.bootstrap_servers, consumer_config=KAFKA_TEST_CONSUMER)

    def crash(self, broker: Broker) -> None:
        # The consumer goes away without committing anything (what a killed process
        # leaves behind); leaving the group lets the next consumer in at once.
        # Bounded like KafkaBroker.close(): librdkafka's close has no timeout of its own.
        for state in broker._groups.values():  # type: ignore[attr-defined]
            broker._close_consumer(state.consumer)  # type: ignore[attr-defined]
        broker._groups.clear()  # type: ignore[attr-defined]


class NatsHarness(Harness):
    name = "nats"
    crash_window = 3.0  # the visibility timeout (ack_wait) plus a fetch
    quiet = 1.5

    def __init__(self, unique: str) -> None:
        require_library("nats", "NatsJetStreamBroker")
        super().__init__(unique)
        self.url = services.require("nats")

    def _make(self) -> Any:
        from msgpatterns.brokers import NatsJetStreamBroker

        return NatsJetStreamBroker(self.url, visibility_timeout=1.0)

    def crash(self, broker: Broker) -> None:
        broker.close()  # type: ignore[attr-defined]  # held deliveries are never acked

    def cleanup(self) -> None:
        super().cleanup()
        delete_nats_stream(self.url, self.topic)


def delete_nats_stream(url: str, topic: str) -> None:
    import asyncio

    import nats

    from msgpatterns.brokers.nats_jetstream import NatsJetStreamBroker

    async def delete() -> None:
        nc = await nats.connect(url)
        try:
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(NatsJetStreamBroker.stream_name(topic))
        finally:
            await nc.close()

    asyncio.run(delete())


HARNESSES: dict[str, type[Harness]] = {
    "memory": MemoryHarness,
    "redis": RedisHarness,
    "rabbitmq": RabbitMQHarness,
    "kafka": KafkaHarness,
    "nats": NatsHarness,
}

MARKS = {"redis": pytest.mark.redis, "rabbitmq": pytest.mark.rabbitmq,
         "kafka": pytest.mark.kafka, "nats": pytest.mark.nats}


def harness_params() -> list[Any]:
    return [pytest.param(name, marks=[MARKS[name]] if name in MARKS else [], id=name)
            for name in HARNESSES]


def make_harness(name: str) -> Iterator[Harness]:
    harness = HARNESSES[name](uuid.uuid4().hex[:10])
    try:
        yield harness
    finally:
        harness.cleanup()
