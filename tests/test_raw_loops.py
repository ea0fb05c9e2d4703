"""Raw client loops settled by msgpatterns (issue 13, item 1), on the real servers (Kafka:
the librdkafka mock cluster): ``NeedRetry(delay)`` is honoured and never early, ``Reject``
is dead-lettered, the attempt count is carried, the ``dlq`` CLI lists and replays the
raw loop's dead letters, and the adapter and the raw loop read each other's retries."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker_harness import KAFKA_TEST_CONSUMER, drain, eventually, kafka_cluster, require_library
from msgpatterns import Backoff, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns import headers as h
from msgpatterns.cli import main as cli
from msgpatterns.settlement import Ack, DeadLetterIt, Decision, RetryLater

pytestmark = pytest.mark.timeout(60)

POLICY = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(5.0), local_retries=0)
DELAY = 0.3


class Script:
    """The handler of every test: m-retry asks for a retry in DELAY seconds once,
    m-reject is rejected until ``lenient``; every call is recorded with its time."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []  # (body, attempt, monotonic)
        self.lenient = False

    def __call__(self, message: Message) -> str:
        body = message.raw_body.decode()
        self.calls.append((body, message.attempt, time.monotonic()))
        if body == "m-retry" and message.attempt == 1:
            raise NeedRetry(delay=DELAY, reason="busy")
        if body == "m-reject" and not self.lenient:
            raise Reject("not today")
        return body

    def attempts(self, body: str) -> list[int]:
        return [a for b, a, _ in self.calls if b == body]

    def times(self, body: str) -> list[float]:
        return [t for b, _, t in self.calls if b == body]


def dlq_json(url: str, topic: str, group: str, capsys: pytest.CaptureFixture[str]
             ) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert cli(["dlq", "list", url, "--topic", topic, "--group", group, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def check_flow(script: Script, decisions: list[tuple[str, Decision]], url: str, topic: str,
               group: str, capsys: pytest.CaptureFixture[str],
               run_until: Callable[[Callable[[], bool]], None]) -> None:
    """The shared assertions: the retry came back as attempt 2 no earlier than DELAY,
    the reject is a dead letter the CLI lists and replays (attempt 1 again)."""
    run_until(lambda: script.attempts("m-retry") == [1, 2]
              and any(isinstance(d, DeadLetterIt) for _, d in decisions))
    first, second = script.times("m-retry")
    assert second - first >= DELAY  # never early
    [retry] = [d for b, d in decisions if b == "m-retry" and isinstance(d, RetryLater)]
    assert retry.delay == DELAY and retry.attempt == 2
    assert script.attempts("m-ok") == [1]

    [record] = dlq_json(url, topic, group, capsys)
    assert record["reason"] == "rejected: not today"
    assert record["group"] == group and record["attempts"] == 1
    script.lenient = True
    assert cli(["dlq", "replay", url, "--topic", topic, "--group", group, "--all"]) == 0
    run_until(lambda: script.attempts("m-reject") == [1, 1])
    assert dlq_json(url, topic, group, capsys) == []
    assert isinstance(decisions[-1][1], Ack)


# -- redis-py -----------------------------------------------------------------------------


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[Any]:
    require_library("redis", "RedisLoop")
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def redis_cleanup(client: Any, topic: str, group: str) -> None:
    client.delete(topic, f"{topic}:retry:{group}", f"{topic}:delayed:{group}",
                  f"{topic}:dlq")


@pytest.mark.redis
def test_redis_loop_retry_reject_attempts_and_dlq_cli(
        redis_client: Any, redis_url: str, unique: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from msgpatterns.raw.redis import RedisLoop

    topic, group = f"raw-{unique}", "g"
    script, decisions = Script(), []
    loop = RedisLoop(redis_client, group=group, consumer="c1")
    try:
        loop.subscribe(topic)
        for body in ("m-ok", "m-retry", "m-reject"):
            redis_client.xadd(topic, {"body": body})

        def run_until(condition: Callable[[], bool]) -> None:
            give_up = time.monotonic() + 15
            while not condition():
                assert time.monotonic() < give_up, script.calls
                wait = loop.promote(topic)
                reply = redis_client.xreadgroup(group, "c1", loop.streams(topic), count=10,
                                                block=loop.block_ms(wait, 0.1))
                for message in loop.messages(reply):
                    decisions.append((message.raw_body.decode(),
                                      loop.handle(message, script, policy=POLICY)))

        check_flow(script, decisions, redis_url, topic, group, capsys, run_until)
        assert redis_client.xpending(topic, group)["pending"] == 0
    finally:
        loop.close()
        redis_cleanup(redis_client, topic, group)


@pytest.mark.redis
def test_redis_loop_and_adapter_read_each_others_retries(redis_client: Any,
                                                         unique: str) -> None:
    from msgpatterns.brokers import RedisStreamsBroker
    from msgpatterns.raw.redis import RedisLoop

    topic, group = f"raw-{unique}", "g"
    broker = RedisStreamsBroker(redis_client, consumer="adapter", ack_flush_interval=0)
    loop = RedisLoop(redis_client, group=group, consumer="raw")
    try:
        loop.subscribe(topic)
        sent = broker.publish(topic, b"m1", key="k1", headers={"trace": "t1"})
        reply = redis_client.xreadgroup(group, "raw", loop.streams(topic), count=1)
        [message] = loop.messages(reply)
        assert (message.id, message.key, message.attempt) == (sent, "k1", 1)
        loop.apply(message, RetryLater(0.0, ValueError("x"), {h.ATTEMPT: "2", "trace": "t1"}))

        [again] = drain(broker, topic, group, count=1, within=5)  # the adapter's side
        assert (again.id, again.key, again.attempt) == (sent, "k1", 2)
        assert again.headers["trace"] == "t1"
        broker.nack(again, 0.0)  # and back to the raw loop: attempt 3

        def read() -> list[Message]:
            loop.promote(topic)
            return loop.messages(redis_client.xreadgroup(
                group, "raw", loop.streams(topic), count=1, block=50))
        [third] = eventually(read, timeout=5)
        assert (third.id, third.attempt) == (sent, 3)
        loop.apply(third, Ack())
        assert redis_client.xlen(f"{topic}:retry:{group}") == 0  # settled entries go
    finally:
        loop.close()
        broker.close()
        redis_cleanup(redis_client, topic, group)


@pytest.mark.redis
def test_redis_loop_recovers_its_own_pending_list_and_stale_entries(
        redis_client: Any, unique: str) -> None:
    from msgpatterns.raw.redis import RedisLoop

    topic, group = f"raw-{unique}", "g"
    try:
        crashed = RedisLoop(redis_client, group=group, consumer="c1")
        crashed.subscribe(topic)
        for n in range(5):
            redis_client.xadd(topic, {"body": f"m{n}"})
        # c1 reads three and dies; c2 reads the other two and dies
        crashed.messages(redis_client.xreadgroup(group, "c1", {topic: ">"}, count=3))
        crashed.messages(redis_client.xreadgroup(group, "c2", {topic: ">"}, count=2))

        restarted = RedisLoop(redis_client, group=group, consumer="c1",
                              visibility_timeout=0.05)
        first = restarted.recover(topic, count=2)  # its own list, a page at a time
        assert [m.raw_body for m in first] == [b"m0", b"m1"]
        assert [m.attempt for m in first] == [2, 2]  # the crash counted
        for m in first:
            restarted.apply(m, Ack())
        time.sleep(0.06)  # let c2's deliveries become stale
        rest = restarted.recover(topic)
        assert sorted(m.raw_body for m in rest) == [b"m2", b"m3", b"m4"]
        assert all(m.attempt == 2 for m in rest)
        for m in rest:
            restarted.apply(m, Ack())
        assert restarted.recover(topic) == []
        assert redis_client.xpending(topic, group)["pending"] == 0
        restarted.close()
    finally:
        redis_cleanup(redis_client, topic, group)


# -- confluent-kafka ----------------------------------------------------------------------


@pytest.fixture
def kafka_clients(unique: str) -> Iterator[tuple[Any, Any, str, str]]:
    cluster = kafka_cluster()
    from confluent_kafka import Consumer, Producer

    group = f"raw-{unique}"
    producer = Producer({"bootstrap.servers": cluster.bootstrap_servers})
    consumer = Consumer({
        "bootstrap.servers": cluster.bootstrap_servers, "group.id": group,
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
        **KAFKA_TEST_CONSUMER,
    })
    yield consumer, producer, cluster.url, group
    with contextlib.suppress(RuntimeError):  # closed by the test
        consumer.close()


def kafka_run_until(loop: Any, consumer: Any, handler: Callable[[Message], Any],
                    decisions: list[tuple[str, Decision]]) -> Callable[[Callable[[], bool]], None]:
    def run_until(condition: Callable[[], bool]) -> None:
        give_up = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < give_up, decisions
            wait = loop.maintain()
            record = consumer.poll(0.1 if wait is None else min(wait, 0.1))
            message = None if record is None else loop.message(record)
            if message is not None:
                decisions.append((message.raw_body.decode(),
                                  loop.handle(message, handler, policy=POLICY)))
    return run_until


@pytest.mark.kafka
def test_kafka_loop_retry_reject_attempts_and_dlq_cli(
        kafka_clients: tuple[Any, Any, str, str], unique: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from msgpatterns.raw.kafka import KafkaLoop

    consumer, producer, url, group = kafka_clients
    topic = f"raw-{unique}"
    for body in ("m-ok", "m-retry", "m-reject"):
        producer.produce(topic, value=body.encode(), key=b"same-partition")
    assert producer.flush(10) == 0
    script, decisions = Script(), []
    loop = KafkaLoop(consumer, group=group, topics=[topic], producer=producer)
    try:
        check_flow(script, decisions, url, topic, group, capsys,
                   kafka_run_until(loop, consumer, script, decisions))
        committed = loop.commit()  # all three settled: the whole partition
        assert [pos for (t, _), pos in committed.items() if t == topic] == [3]
    finally:
        loop.close()


@pytest.mark.kafka
def test_kafka_loop_commits_only_the_contiguous_settled_prefix(
        kafka_clients: tuple[Any, Any, str, str], unique: str) -> None:
    from msgpatterns.raw.kafka import KafkaLoop

    consumer, producer, _, group = kafka_clients
    topic = f"raw-{unique}"
    for n in range(3):
        producer.produce(topic, value=f"m{n}".encode(), key=b"same-partition")
    assert producer.flush(10) == 0
    loop = KafkaLoop(consumer, group=group, topics=[topic], producer=producer)
    try:
        got: list[Message] = []

        def poll() -> bool:
            record = consumer.poll(0.1)
            message = None if record is None else loop.message(record)
            if message is not None:
                got.append(message)
            return len(got) == 3
        eventually(poll, timeout=20)
        where = (topic, got[0].partition)
        loop.apply(got[2], Ack())
        loop.apply(got[0], Ack())
        assert loop.commit()[where] == got[0].offset + 1  # m1 still open: not past it
        loop.apply(got[1], Ack())
        assert loop.commit()[where] == got[2].offset + 1
    finally:
        loop.close()


@pytest.mark.kafka
def test_kafka_adapter_reads_the_raw_loops_retry(
        kafka_clients: tuple[Any, Any, str, str], unique: str) -> None:
    from broker_harness import KafkaHarness
    from msgpatterns.raw.kafka import KafkaLoop

    consumer, producer, _, group = kafka_clients
    topic = f"raw-{unique}"
    producer.produce(topic, value=b"m1", headers=[("trace", b"t1")])
    assert producer.flush(10) == 0
    loop = KafkaLoop(consumer, group=group, topics=[topic], producer=producer)
    got: list[Message] = []

    def poll() -> bool:
        record = consumer.poll(0.1)
        message = None if record is None else loop.message(record)
        if message is not None:
            got.append(message)
        return bool(got)
    eventually(poll, timeout=20)
    loop.apply(got[0], RetryLater(0.0, ValueError("x"), {h.ATTEMPT: "2", "trace": "t1"}))
    loop.close()
    consumer.close()  # the group's next member is the adapter

    harness = KafkaHarness(unique)
    harness.topic, harness.group = topic, group
    broker = harness.broker()
    try:
        [again] = drain(broker, topic, group, count=1, within=15)
        assert (again.id, again.attempt, again.headers["trace"]) == (got[0].id, 2, "t1")
    finally:
        broker.close()  # type: ignore[attr-defined]



# -- pika -----------------------------------------------------------------------------------


@pytest.fixture
def pika_channel(rabbitmq_url: str, unique: str) -> Iterator[tuple[Any, Any, str, str]]:
    require_library("pika", "PikaLoop")
    import pika

    from broker_harness import delete_rabbitmq_topology

    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    topic = f"raw-{unique}"
    yield connection, connection.channel(), topic, "g"
    with contextlib.suppress(Exception):
        connection.close()
    delete_rabbitmq_topology(rabbitmq_url, topic, "g")
    cleanup = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    channel = cleanup.channel()
    channel.queue_delete(f"{topic}.g.retry.{int(DELAY * 1000)}")
    cleanup.close()


def get_one(channel: Any, loop: Any, queue: str) -> Message:
    def get() -> Message | None:
        method, properties, body = channel.basic_get(queue)
        return None if method is None else loop.message(method, properties, body)
    message: Message = eventually(get, timeout=10)
    return message


@pytest.mark.rabbitmq
def test_pika_loop_retry_reject_attempts_and_dlq_cli(
        pika_channel: tuple[Any, Any, str, str], rabbitmq_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from msgpatterns.raw.pika import PikaLoop

    connection, channel, topic, group = pika_channel
    script, decisions = Script(), []
    loop = PikaLoop(channel, topic=topic, group=group)

    def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
        message = loop.message(method, properties, body)
        if message is not None:
            decisions.append((body.decode(), loop.handle(message, script, policy=POLICY)))

    channel.basic_consume(loop.declare(), on_message)
    for body in ("m-ok", "m-retry", "m-reject"):
        channel.basic_publish(topic, topic, body.encode())

    def run_until(condition: Callable[[], bool]) -> None:
        give_up = time.monotonic() + 15
        while not condition():
            assert time.monotonic() < give_up, script.calls
            connection.process_data_events(time_limit=0.02)

    check_flow(script, decisions, rabbitmq_url, topic, group, capsys, run_until)
    loop.close()


@pytest.mark.rabbitmq
def test_pika_loop_and_adapter_read_each_others_retries(
        pika_channel: tuple[Any, Any, str, str], rabbitmq_url: str) -> None:
    from msgpatterns.brokers import RabbitMQBroker
    from msgpatterns.raw.pika import PikaLoop

    _, channel, topic, group = pika_channel
    loop = PikaLoop(channel, topic=topic, group=group)
    queue = loop.declare()
    with RabbitMQBroker(rabbitmq_url) as broker:
        sent = broker.publish(topic, b"m1", key="k1", headers={"trace": "t1"})
        message = get_one(channel, loop, queue)
        assert (message.id, message.key, message.attempt) == (sent, "k1", 1)
        loop.apply(message, RetryLater(0.0, ValueError("x"), {h.ATTEMPT: "2", "trace": "t1"}))

        [again] = drain(broker, topic, group, count=1, within=10)  # the adapter's side
        assert (again.id, again.key, again.attempt, again.headers["trace"]) == (
            sent, "k1", 2, "t1")
        broker.nack(again, DELAY)  # and back to the raw loop through the TTL queue
    third = get_one(channel, loop, queue)  # (the adapter has stopped consuming)
    assert (third.id, third.attempt) == (sent, 3)
    loop.apply(third, Ack())
    loop.close()


@pytest.mark.rabbitmq
def test_pika_loop_counts_a_crash_and_dead_letters_a_bad_attempt_header(
        pika_channel: tuple[Any, Any, str, str], rabbitmq_url: str) -> None:
    import pika

    from msgpatterns.brokers import RabbitMQBroker
    from msgpatterns.raw.pika import PikaLoop

    connection, channel, topic, group = pika_channel
    loop = PikaLoop(channel, topic=topic, group=group)
    queue = loop.declare()
    channel.basic_publish(topic, topic, b"m1")
    doomed = connection.channel()
    first = get_one(doomed, PikaLoop(doomed, topic=topic, group=group), queue)
    assert (first.raw_body, first.attempt) == (b"m1", 1)
    doomed.close()  # dies without settling: the quorum queue counts the delivery

    again = get_one(channel, loop, queue)
    assert (again.raw_body, again.attempt) == (b"m1", 2)
    loop.apply(again, Ack())

    channel.basic_publish(topic, topic, b"m2", pika.BasicProperties(
        message_id="bad", headers={h.ATTEMPT: "zero"}))

    def buried() -> bool:
        method, properties, body = channel.basic_get(queue)
        return method is not None and loop.message(method, properties, body) is None
    eventually(buried, timeout=10)
    with RabbitMQBroker(rabbitmq_url) as broker:
        [record] = broker.list_dead_letters(topic, group)
    assert record.id == "bad" and h.ATTEMPT in record.reason
    assert channel.queue_declare(queue, passive=True).method.message_count == 0
    loop.close()


@pytest.mark.rabbitmq
def test_pika_loop_dead_letters_an_oversized_delivery(
        pika_channel: tuple[Any, Any, str, str], rabbitmq_url: str) -> None:
    """``max_message_bytes`` on the raw pika loop: a larger delivery never reaches the
    handler, it is dead-lettered with its size and the bound; the next is delivered."""
    from msgpatterns.brokers import RabbitMQBroker
    from msgpatterns.raw.pika import PikaLoop

    _, channel, topic, group = pika_channel
    loop = PikaLoop(channel, topic=topic, group=group, max_message_bytes=1000)
    queue = loop.declare()
    channel.basic_publish(topic, topic, b"B" * 5000)
    channel.basic_publish(topic, topic, b"small")

    def buried() -> bool:
        method, properties, body = channel.basic_get(queue)
        return method is not None and loop.message(method, properties, body) is None
    eventually(buried, timeout=10)
    small = get_one(channel, loop, queue)
    assert small.raw_body == b"small"
    loop.apply(small, Ack())
    with RabbitMQBroker(rabbitmq_url) as broker:
        [record] = eventually(lambda: broker.list_dead_letters(topic, group), timeout=10)
    assert record.message.raw_body == b"B" * 5000
    assert "5000 bytes, over max_message_bytes=1000" in record.reason
    loop.close()


def _raw_loop(name: str, max_message_bytes: object) -> Any:
    if name == "redis":
        require_library("redis", "RedisLoop")
        import redis

        from msgpatterns.raw.redis import RedisLoop

        return RedisLoop(redis.Redis.from_url("redis://127.0.0.1:1"), group="g",
                         consumer="c", max_message_bytes=max_message_bytes)
    if name == "kafka":
        require_library("confluent_kafka", "KafkaLoop")
        from msgpatterns.raw.kafka import KafkaLoop

        return KafkaLoop(object(), group="g", topics=["t"], producer=object(),
                         max_message_bytes=max_message_bytes)
    require_library("pika", "PikaLoop")
    from msgpatterns.raw.pika import PikaLoop

    return PikaLoop(object(), topic="t", group="g",
                    max_message_bytes=max_message_bytes)


@pytest.mark.parametrize(("loop_name", "bad"), [("redis", 0), ("kafka", -1), ("pika", True)])
def test_raw_loops_refuse_a_bad_max_message_bytes(loop_name: str, bad: object) -> None:
    from msgpatterns.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="max_message_bytes"):
        _raw_loop(loop_name, bad)
