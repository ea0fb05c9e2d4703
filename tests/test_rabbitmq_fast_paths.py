"""RabbitMQBroker's cheaper consume/ack path, checked against its plain twin and on the
real server.

* ``_message`` (deliveries without library headers skip the transport split) builds
  the same Message as ``_message_plain`` for generated deliveries - header tables of
  the server's own headers, valid or not, with or without library and user headers,
  ids as text or bytes, timestamps or none, redelivered or not - and raises the same
  error when one is malformed.
* Acks handed to the I/O thread in bulk (no operation object per ack) keep
  ``close()``'s promise under a race: every ack that returned is sent (never
  redelivered); every ack refused with BrokerClosed is redelivered.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_harness import delete_rabbitmq_topology, drain, require_library
from msgpatterns import headers as h
from msgpatterns.errors import BrokerClosed, MalformedMessage
from msgpatterns.message import Message

pika = pytest.importorskip("pika")

from msgpatterns.brokers.rabbitmq import RabbitMQBroker  # noqa: E402

_SERVER_HEADERS = ["x-death", "x-delivery-count", "x-first-death-queue",
                   "x-last-death-reason"]
_header_value = st.one_of(
    st.none(), st.integers(-3, 10**6), st.booleans(), st.text(max_size=8),
    st.binary(max_size=8), st.floats(allow_nan=True), st.lists(st.integers(), max_size=2),
)
_library = st.sampled_from([h.ATTEMPT, "msgpatterns-key", "msgpatterns-id",
                            "traceparent", "user-header"])
_headers = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(st.sampled_from(_SERVER_HEADERS), _header_value, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(_SERVER_HEADERS), _library),
                    st.one_of(_header_value, st.integers(1, 5).map(str)), max_size=4),
)


def _fields(message: Message) -> tuple[Any, ...]:
    return (message.raw_body, message.id, message.key, message.topic,
            dict(message.headers), message.attempt)


@settings(max_examples=400, deadline=None)
@given(headers=_headers,
       message_id=st.one_of(st.none(), st.text(max_size=6), st.binary(max_size=6)),
       timestamp=st.one_of(st.none(), st.integers(0, 2**40)),
       redelivered=st.booleans(),
       body=st.binary(max_size=8))
def test_message_shortcut_matches_the_plain_twin(headers: Any, message_id: Any,
                                                 timestamp: Any, redelivered: bool,
                                                 body: bytes) -> None:
    method = pika.spec.Basic.Deliver(consumer_tag="c", delivery_tag=1,
                                     redelivered=redelivered, exchange="t", routing_key="t")
    props = pika.BasicProperties(headers=headers, message_id=message_id, timestamp=timestamp)
    outcomes = []
    for build in (RabbitMQBroker._message, RabbitMQBroker._message_plain):
        try:
            message = build("topic", method, props, body)
        except MalformedMessage as exc:
            outcomes.append(("malformed", str(exc)))
        else:
            stamp = message.timestamp if timestamp is not None else None
            outcomes.append(("message", (*_fields(message), stamp)))
    assert outcomes[0] == outcomes[1]


# -- the real server ----------------------------------------------------------------


@pytest.fixture
def rabbitmq_url(rabbitmq_url: str) -> str:
    require_library("pika", "RabbitMQBroker")
    return rabbitmq_url


@pytest.fixture
def names(rabbitmq_url: str, unique: str) -> Iterator[tuple[str, str]]:
    topic, group = f"fp-{unique}", f"g-{unique}"
    yield topic, group
    delete_rabbitmq_topology(rabbitmq_url, topic, group)


@pytest.mark.rabbitmq
@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_acks_racing_close_are_sent_or_refused_never_lost(
    rabbitmq_url: str, names: tuple[str, str], queue_type: str
) -> None:
    topic, group = names
    total = 400
    broker = RabbitMQBroker(rabbitmq_url, prefetch=total, queue_type=queue_type)
    broker.subscribe(topic, group)
    broker.publish_many(topic, [str(i).encode() for i in range(total)])
    got = drain(broker, topic, group, count=total, within=30, batch=total)
    assert len(got) == total
    sent: list[int] = []
    refused: list[int] = []
    lock = threading.Lock()
    go = threading.Barrier(5)
    quarter = threading.Event()  # close once a quarter of the acks went through

    def acker(share: list[Message]) -> None:
        go.wait()
        for message in share:
            try:
                broker.ack(message)
            except BrokerClosed:
                with lock:
                    refused.append(int(message.raw_body))
            else:
                with lock:
                    sent.append(int(message.raw_body))
                    if len(sent) >= total // 4:
                        quarter.set()

    threads = [threading.Thread(target=acker, args=(got[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    go.wait()
    assert quarter.wait(30)
    broker.close()
    for thread in threads:
        thread.join(30)
    assert sorted(sent + refused) == list(range(total))
    again = RabbitMQBroker(rabbitmq_url, prefetch=total, queue_type=queue_type)
    try:
        back = drain(again, topic, group, within=3, batch=total)  # all that come back
        assert sorted(int(m.raw_body) for m in back) == sorted(refused)
        for message in back:
            again.ack(message)
    finally:
        again.close()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=20), max_size=8))
def test_coalesced_output_is_the_same_bytes_in_one_chunk(frames: list[bytes]) -> None:
    from collections import deque
    from types import SimpleNamespace

    from msgpatterns.brokers.rabbitmq import coalesce_output

    buffers = deque(frames)
    conn = SimpleNamespace(_impl=SimpleNamespace(_transport=SimpleNamespace(
        _tx_buffers=buffers)))
    coalesce_output(conn)
    assert b"".join(buffers) == b"".join(frames)
    assert len(buffers) == min(1, len(frames))
    coalesce_output(SimpleNamespace())  # a pika that looks different: nothing happens
