"""``publish_many`` on the adapters (issue 13, item 6): ids in order, each message as
``publish`` would send it, one round trip per batch, and the failure semantics.

The asyncio adapters (``rabbitmq-async``: :class:`~msgpatterns.aio.AsyncRabbitMQBroker`,
``nats-async``: :class:`~msgpatterns.aio.AsyncNatsJetStreamBroker`) run the same test
bodies: each is driven through :class:`OnALoop`, a sync face that runs every coroutine
on an event loop of its own."""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker_harness import HARNESSES, Harness, NatsHarness, RabbitMQHarness, drain, require_library
from msgpatterns.brokers import Outgoing, PartialPublish

pytestmark = pytest.mark.timeout(60)


class OnALoop:
    """An async adapter behind the sync face: each coroutine method runs on a private
    event loop thread and is waited for (the broker is built on that loop)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def build() -> Any:
            return make()

        self.broker = self.run(build())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.broker, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        return lambda *args, **kwargs: self.run(attr(*args, **kwargs))

    def close(self) -> None:
        try:
            self.run(self.broker.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class AsyncRabbitMQHarness(RabbitMQHarness):
    name = "rabbitmq-async"

    def __init__(self, unique: str) -> None:
        require_library("aio_pika", "AsyncRabbitMQBroker")
        super().__init__(unique)

    def _make(self) -> Any:
        from msgpatterns.aio import AsyncRabbitMQBroker

        return OnALoop(lambda: AsyncRabbitMQBroker(self.url, prefetch=50))


class AsyncNatsHarness(NatsHarness):
    name = "nats-async"

    def _make(self) -> Any:
        from msgpatterns.aio import AsyncNatsJetStreamBroker

        return OnALoop(lambda: AsyncNatsJetStreamBroker(self.url, visibility_timeout=1.0))


KINDS: dict[str, type[Harness]] = {**HARNESSES, "rabbitmq-async": AsyncRabbitMQHarness,
                                   "nats-async": AsyncNatsHarness}


@pytest.fixture(params=[
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("kafka", marks=pytest.mark.kafka),
    pytest.param("nats", marks=pytest.mark.nats),
    pytest.param("nats-async", marks=pytest.mark.nats),
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("rabbitmq-async", marks=pytest.mark.rabbitmq),
])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    made = KINDS[request.param](uuid.uuid4().hex[:10])
    try:
        yield made
    finally:
        made.cleanup()


def test_publish_many_sends_each_message_like_publish(harness: Harness) -> None:
    broker: Any = harness.broker()
    items = [b"plain", Outgoing(b"keyed", key="k1", headers={"trace": "t1"}),
             *(Outgoing(f"m{n}".encode(), key="k2") for n in range(20))]
    ids = broker.publish_many(harness.topic, items)
    assert len(ids) == len(items) == len(set(ids))
    single = broker.publish(harness.topic, b"after", key="k1")

    got = drain(broker, harness.topic, harness.group, count=len(items) + 1, batch=50)
    by_id = {m.id: m for m in got}
    assert set(by_id) == {*ids, single}
    assert by_id[ids[0]].raw_body == b"plain" and by_id[ids[0]].key is None
    keyed = by_id[ids[1]]
    assert (keyed.raw_body, keyed.key, keyed.headers.get("trace")) == (b"keyed", "k1", "t1")
    same_key = [m.raw_body for m in got if m.key == "k2"]
    assert same_key == [f"m{n}".encode() for n in range(20)]  # a key keeps its order
    assert all(m.attempt == 1 for m in got)
    for m in got:
        broker.ack(m)


def test_publish_many_confirms_every_message_of_a_large_batch(harness: Harness) -> None:
    """Confirms that arrive while the batch is still being written count too."""
    broker: Any = harness.broker()
    for _ in range(2):
        ids = broker.publish_many(harness.topic, [str(i).encode() for i in range(1000)])
        assert len(set(ids)) == 1000


def test_publish_many_refuses_one_body_and_accepts_none(harness: Harness) -> None:
    broker: Any = harness.broker()
    with pytest.raises(TypeError, match="sequence of bodies"):
        broker.publish_many(harness.topic, b"one body")
    assert broker.publish_many(harness.topic, []) == []


@pytest.mark.redis
def test_redis_publish_many_refused_adds_nothing(unique: str) -> None:
    import redis

    from msgpatterns.brokers import RedisStreamsBroker
    from msgpatterns.errors import BrokerError
    from msgpatterns.testing import services

    client = redis.Redis.from_url(services.require("redis"))
    broker = RedisStreamsBroker(client)
    topic = f"pm-{unique}"
    try:
        client.set(topic, "not a stream")
        with pytest.raises(BrokerError, match="WRONGTYPE"):
            broker.publish_many(topic, [b"a", b"b"])
        assert client.type(topic) == b"string"
    finally:
        broker.close()
        client.delete(topic)
        client.close()


class _FlakyProducer:
    """A confluent-kafka Producer stand-in that refuses the second record's delivery."""

    def __init__(self) -> None:
        self.waiting: list[Any] = []
        self.count = 0

    def list_topics(self, *args: Any, **kwargs: Any) -> None:
        return None

    def produce(self, topic: str, **kwargs: Any) -> None:
        self.count += 1
        self.waiting.append((self.count, kwargs["on_delivery"]))

    def flush(self, timeout: float = 0) -> int:
        for n, callback in self.waiting:
            callback("broker said no" if n == 2 else None, object())
        self.waiting = []
        return 0

    poll = flush


def test_kafka_publish_many_reports_which_were_confirmed() -> None:
    pytest.importorskip("confluent_kafka")
    from msgpatterns.brokers import KafkaBroker

    broker = KafkaBroker("localhost:1", producer=_FlakyProducer())
    with pytest.raises(PartialPublish) as caught:
        broker.publish_many("t", [b"a", b"b", b"c"])
    ids = caught.value.ids
    assert ids[0] is not None and ids[1] is None and ids[2] is not None
    assert caught.value.confirmed == 2 and "2 of 3" in str(caught.value)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_rabbitmq_publish_many_to_a_missing_exchange_sends_nothing(unique: str,
                                                                   kind: str) -> None:
    from msgpatterns.errors import UnroutableError
    from msgpatterns.testing import services

    url = services.require("rabbitmq")
    if kind == "sync":
        from msgpatterns.brokers import RabbitMQBroker

        broker: Any = RabbitMQBroker(url)
    else:
        require_library("aio_pika", "AsyncRabbitMQBroker")
        from msgpatterns.aio import AsyncRabbitMQBroker

        broker = OnALoop(lambda: AsyncRabbitMQBroker(url))
    try:
        with pytest.raises(PartialPublish) as caught:
            broker.publish_many(f"nowhere-{unique}", [b"a", b"b"])
        assert caught.value.ids == [None, None]
        assert isinstance(caught.value.__cause__, UnroutableError)
        topic = f"pm-{unique}"
        broker.subscribe(topic, "g")  # the batch channel is usable again afterwards
        try:
            assert len(broker.publish_many(topic, [b"c", b"d"])) == 2
        finally:
            from broker_harness import delete_rabbitmq_topology

            delete_rabbitmq_topology(services.url("rabbitmq"), topic, "g")
    finally:
        broker.close()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_rabbitmq_publish_many_with_no_queue_bound_confirms_nothing(unique: str,
                                                                    kind: str) -> None:
    """The exchange exists but no queue is bound: each message is returned, none is
    confirmed as kept (PartialPublish, its cause an UnroutableError on asyncio)."""
    import pika

    from msgpatterns.testing import services

    url = services.require("rabbitmq")
    topic = f"unbound-{unique}"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().exchange_declare(topic, "fanout", durable=False, auto_delete=False)
        if kind == "sync":
            from msgpatterns.brokers import RabbitMQBroker

            broker: Any = RabbitMQBroker(url)
        else:
            require_library("aio_pika", "AsyncRabbitMQBroker")
            from msgpatterns.aio import AsyncRabbitMQBroker

            broker = OnALoop(lambda: AsyncRabbitMQBroker(url))
        try:
            with pytest.raises(PartialPublish) as caught:
                broker.publish_many(topic, [b"a", b"b", b"c"])
            assert caught.value.ids == [None, None, None]
        finally:
            broker.close()
    finally:
        conn.channel().exchange_delete(topic)
        conn.close()
