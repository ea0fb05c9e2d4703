"""The :class:`~msgpatterns.brokers.admin.DeadLetterAdmin` protocol, one suite for every
adapter on its real server (Kafka: librdkafka's mock cluster): list (by group, with a
limit), replay to the group or to the topic with attempts reset, purge, ``knows``, and
the shortcuts on the broker that delegate to the admin."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_harness import Harness, drain, eventually, harness_params, make_harness
from msgpatterns import DeadLetter, Message, Reject
from msgpatterns.brokers import DeadLetterAdmin
from msgpatterns.errors import BrokerClosed, ConfigurationError

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=harness_params())
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from make_harness(request.param)


def bury(harness: Harness, broker: object, count: int) -> list[str]:
    """Publish ``count`` messages and dead-letter each delivery; their ids in order."""
    ids = [broker.publish(harness.topic, f"m{i}".encode(), key=f"k{i}",  # type: ignore[attr-defined]
                          headers={"n": str(i)}) for i in range(count)]
    got = drain(broker, harness.topic, harness.group, count=count, within=20)  # type: ignore[arg-type]
    assert sorted(m.id or "" for m in got) == sorted(ids)
    for message in got:
        record = DeadLetter.from_error(message, Reject(f"no {message.raw_body!r}"),
                                       now=broker.now(), group=harness.group)  # type: ignore[attr-defined]
        broker.dead_letter(message, record)  # type: ignore[attr-defined]
    return ids


def test_list_replay_purge_through_the_protocol(h: Harness) -> None:
    broker = h.broker()
    ids = bury(h, broker, 3)
    admin = broker.dead_letter_admin()  # type: ignore[attr-defined]
    assert isinstance(admin, DeadLetterAdmin)

    records = eventually(lambda: (lambda r: r if len(r) == 3 else None)(
        admin.list_dead_letters(h.topic, h.group)), timeout=20)
    assert sorted(r.id for r in records) == sorted(ids)
    for record in records:
        assert record.group == h.group
        assert record.error_type.endswith("Reject")
        assert record.message.headers.get("n") == record.message.raw_body.decode()[1:]
    assert len(admin.list_dead_letters(h.topic, h.group, limit=1)) == 1
    assert admin.knows(h.topic, h.group)
    assert not admin.knows(f"{h.topic}-never-used", h.group)

    first, second, third = ids
    assert admin.replay_dead_letters(h.topic, h.group, ids=["no-such-id"]) == 0
    assert admin.replay_dead_letters(h.topic, h.group, ids=[first]) == 1
    [back] = drain(broker, h.topic, h.group, count=1, within=20)
    assert (back.id, back.raw_body, back.key, back.attempt) == (first, b"m0", "k0", 1)
    assert back.headers.get("n") == "0"
    broker.ack(back)

    assert admin.replay_dead_letters(h.topic, h.group, ids=[second], to_topic=True) == 1
    [again] = drain(broker, h.topic, h.group, count=1, within=20)
    assert (again.id, again.raw_body, again.attempt) == (second, b"m1", 1)
    broker.ack(again)

    left = admin.list_dead_letters(h.topic, h.group)
    assert [r.id for r in left] == [third]
    assert broker.purge_dead_letters(h.topic, h.group, ids=[third]) == 1  # type: ignore[attr-defined]
    assert admin.list_dead_letters(h.topic, h.group) == []
    assert admin.purge_dead_letters(h.topic, h.group) == 0
    assert drain(broker, h.topic, h.group, within=h.quiet) == []
    admin.close()
    admin.close()  # idempotent, and the broker stays open
    broker.publish(h.topic, b"still open")  # type: ignore[attr-defined]


def test_the_admin_of_a_closed_broker_refuses(h: Harness) -> None:
    broker = h.broker()
    admin = broker.dead_letter_admin()  # type: ignore[attr-defined]
    broker.close()  # type: ignore[attr-defined]
    with pytest.raises(BrokerClosed):
        broker.list_dead_letters(h.topic, h.group)  # type: ignore[attr-defined]
    with pytest.raises(BrokerClosed):
        admin.list_dead_letters(h.topic, h.group)


def test_a_record_without_a_group_needs_one_to_go_back_to_a_group() -> None:
    from msgpatterns import InMemoryBroker

    broker = InMemoryBroker()
    broker.publish("t", b"x")
    [message] = broker.fetch(["t"], "g")
    broker.dead_letter(message, DeadLetter.from_error(message, Reject("no"), now=broker.now()))
    admin = broker.dead_letter_admin()
    with pytest.raises(ConfigurationError, match="has no group"):
        admin.replay_dead_letters("t")
    assert admin.replay_dead_letters("t", "g") == 1
    [back] = broker.fetch(["t"], "g")
    assert (back.raw_body, back.attempt) == (b"x", 1)
    assert broker.dead_letters == []


def test_every_adapter_hands_out_its_own_admin_class() -> None:
    from msgpatterns.brokers import admin

    for name in ("InMemoryDeadLetters", "RedisStreamsDeadLetters", "RabbitMQDeadLetters",
                 "KafkaDeadLetters", "NatsJetStreamDeadLetters"):
        cls = getattr(admin, name)
        for member in ("list_dead_letters", "replay_dead_letters", "purge_dead_letters",
                       "knows", "close"):
            assert callable(getattr(cls, member)), (name, member)


def test_messages_are_plain_values_to_the_admin() -> None:
    """A record's message is what the handler saw (a value with the original body)."""
    from msgpatterns import InMemoryBroker

    broker = InMemoryBroker()
    broker.publish("t", b"x", key="k")
    [message] = broker.fetch(["t"], "g")
    broker.dead_letter(message, DeadLetter.from_error(message, Reject("no"),
                                                      now=broker.now(), group="g"))
    [record] = broker.dead_letter_admin().list_dead_letters("t")
    assert isinstance(record.message, Message)
    assert (record.message.raw_body, record.message.key) == (b"x", "k")
