"""One public style (issue 11, item 8): the connection first as ``url`` (a URL or a
client object), options keyword-only, the old keyword spellings still accepted, misuse
raised as ``ConfigurationError`` (still a ``ValueError`` and a ``TypeError``), and
``close()`` plus a context manager on the parts that hold a thread."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest

from msgpatterns import Backoff, InMemoryBroker, OrderedExecutor, TimingWheel
from msgpatterns.errors import ClosedError, ConfigurationError, QueueClosed
from msgpatterns.testing import services

ADAPTERS = [
    ("msgpatterns.brokers.redis_streams", "RedisStreamsBroker"),
    ("msgpatterns.brokers.rabbitmq", "RabbitMQBroker"),
    ("msgpatterns.brokers.kafka", "KafkaBroker"),
    ("msgpatterns.brokers.nats_jetstream", "NatsJetStreamBroker"),
    ("msgpatterns.aio.redis_streams", "AsyncRedisStreamsBroker"),
    ("msgpatterns.aio.rabbitmq", "AsyncRabbitMQBroker"),
    ("msgpatterns.aio.kafka", "AsyncKafkaBroker"),
    ("msgpatterns.brokers.admin.redis_streams", "RedisStreamsDeadLetters"),
    ("msgpatterns.brokers.admin.rabbitmq", "RabbitMQDeadLetters"),
]


def _load(module: str, name: str) -> Any:
    return getattr(pytest.importorskip(module), name)


@pytest.mark.parametrize(("module", "name"), ADAPTERS, ids=[n for _, n in ADAPTERS])
def test_the_connection_comes_first_as_url_and_options_are_keyword_only(
        module: str, name: str) -> None:
    params = list(inspect.signature(_load(module, name)).parameters.values())
    assert params[0].name == "url"
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
               for p in params[1:]), [(p.name, p.kind) for p in params[1:]]


@pytest.mark.redis
def test_old_keyword_spellings_still_work_for_redis() -> None:
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker
    from msgpatterns.brokers import RedisStreamsBroker

    url = services.require("redis")
    with RedisStreamsBroker(client_or_url=url) as old:  # type: ignore[call-arg]
        assert old.dead_letter_admin().knows("no-such-topic-here") is False
    with RedisStreamsBroker(url=url):
        pass
    AsyncRedisStreamsBroker(client_or_url=url)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="not both"):
        RedisStreamsBroker(url, client_or_url=url)  # type: ignore[call-arg]


@pytest.mark.rabbitmq
def test_old_keyword_spelling_still_works_for_rabbitmq() -> None:
    from msgpatterns.brokers import RabbitMQBroker

    url = services.require("rabbitmq")
    with RabbitMQBroker(url_or_parameters=url) as broker:  # type: ignore[call-arg]
        assert not broker.closed
    assert broker.closed


@pytest.mark.kafka
def test_old_keyword_spelling_still_works_for_kafka() -> None:
    from broker_harness import kafka_cluster
    from msgpatterns.aio.kafka import AsyncKafkaBroker, ThreadedAsyncKafkaBroker
    from msgpatterns.brokers import KafkaBroker

    bootstrap = kafka_cluster().bootstrap_servers
    with KafkaBroker(bootstrap_or_config=bootstrap) as broker:  # type: ignore[call-arg]
        assert broker.dead_letter_admin().knows("no-such-topic-here") is False
    threaded = ThreadedAsyncKafkaBroker(bootstrap_or_config=bootstrap)  # type: ignore[call-arg]
    threaded.sync.close()
    # AsyncKafkaBroker is the aiokafka adapter now; its constructor does no I/O
    native = AsyncKafkaBroker(bootstrap_or_config=bootstrap)  # type: ignore[call-arg]
    assert native.bootstrap_servers == bootstrap
    with pytest.raises(ConfigurationError, match="not both"):
        AsyncKafkaBroker(bootstrap, bootstrap_or_config=bootstrap)  # type: ignore[call-arg]


def test_configuration_error_is_a_value_error_and_a_type_error() -> None:
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(ConfigurationError, TypeError)


@pytest.mark.parametrize("misuse", [
    lambda: InMemoryBroker(duplicate_rate=2.0),
    lambda: InMemoryBroker(reorder_window=-1),
    lambda: InMemoryBroker().publish_many("t", "one string, not a list"),
    lambda: TimingWheel(tick=0),
    lambda: TimingWheel(slots=0),
    lambda: Backoff.levels([]),
    lambda: Backoff.exponential(factor=0.5),
], ids=["duplicate_rate", "reorder_window", "publish_many-str", "tick", "slots",
        "levels", "exponential"])
def test_misuse_is_a_configuration_error(misuse: Any) -> None:
    with pytest.raises(ConfigurationError):
        misuse()


def test_async_fake_refuses_a_broker_and_options_together() -> None:
    from msgpatterns.aio import AsyncInMemoryBroker

    with pytest.raises(ConfigurationError):
        AsyncInMemoryBroker(InMemoryBroker(), seed=1)
    with pytest.raises(TypeError):  # what it raised before: still caught
        AsyncInMemoryBroker(InMemoryBroker(), seed=1)


def test_a_timing_wheel_closes_as_a_context_manager() -> None:
    fired = threading.Event()
    with TimingWheel(tick=0.01) as wheel:
        wheel.schedule(0.0, fired.set)
        assert fired.wait(5)
        handle = wheel.schedule(3600.0, fired.clear)
    assert handle.cancelled  # close() stopped the wheel: the timer never fires
    with pytest.raises(ClosedError):  # stopped: nothing is scheduled any more
        wheel.schedule(1.0, fired.clear)
    with pytest.raises(RuntimeError):  # what it raised before: still caught
        wheel.schedule(1.0, fired.clear)
    wheel.close()  # idempotent


def test_an_ordered_executor_has_close() -> None:
    ran: list[int] = []
    executor = OrderedExecutor(2)
    futures = [executor.submit("k", ran.append, i) for i in range(5)]
    executor.close()
    assert [f.done() for f in futures] == [True] * 5
    assert ran == [0, 1, 2, 3, 4]
    executor.close()  # idempotent
    with pytest.raises(ClosedError):
        executor.submit("k", ran.append, 5)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


def test_client_library_errors_come_out_as_the_library_own() -> None:
    """An unreachable server is a BrokerUnavailable with the client's exception as its
    cause, from the dead-letter admins as from the adapters."""
    from msgpatterns.errors import BrokerUnavailable

    pytest.importorskip("redis")
    pytest.importorskip("pika")
    from msgpatterns.brokers.admin.rabbitmq import RabbitMQDeadLetters
    from msgpatterns.brokers.admin.redis_streams import RedisStreamsDeadLetters

    port = _closed_port()
    with RedisStreamsDeadLetters(f"redis://127.0.0.1:{port}/0") as admin, \
            pytest.raises(BrokerUnavailable) as caught:
        admin.list_dead_letters("t")
    assert caught.value.__cause__ is not None
    with pytest.raises(BrokerUnavailable) as caught:
        RabbitMQDeadLetters(f"amqp://guest:guest@127.0.0.1:{port}/?connection_attempts=1"
                            ).list_dead_letters("t", "g")
    assert caught.value.__cause__ is not None
    with pytest.raises(ConfigurationError):
        RabbitMQDeadLetters(42)


def test_fetch_takes_one_topic_name_or_a_list_on_every_adapter_alike() -> None:
    """The topic-list normalisation lives in the shared adapter base: a bare name is
    one topic, never a sequence of one-letter topics; a non-string topic is refused."""
    broker = InMemoryBroker()
    broker.publish("orders", b"x")
    [message] = broker.fetch("orders", "g")
    assert message.topic == "orders"
    with pytest.raises(ConfigurationError):
        broker.fetch(["orders", 3], "g")  # type: ignore[list-item]


def test_checkers_take_url_first_and_keep_their_old_keywords(tmp_path: Any) -> None:
    pytest.importorskip("sqlalchemy")
    fakeredis = pytest.importorskip("fakeredis")
    from msgpatterns import RedisChecker, SqlChecker, TransactionalSqlChecker

    for cls in (RedisChecker, SqlChecker, TransactionalSqlChecker):
        assert next(iter(inspect.signature(cls).parameters)) == "url"
    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    for old in (SqlChecker(engine_or_url=url),  # type: ignore[call-arg]
                TransactionalSqlChecker(engine_or_url=url),  # type: ignore[call-arg]
                RedisChecker(client_or_url=fakeredis.FakeRedis())):  # type: ignore[call-arg]
        old.close()
    with pytest.raises(ConfigurationError, match="not both"):
        SqlChecker(url, engine_or_url=url)  # type: ignore[call-arg]


def test_closed_errors_share_one_type() -> None:
    assert issubclass(QueueClosed, ClosedError)
    assert issubclass(ClosedError, RuntimeError)
