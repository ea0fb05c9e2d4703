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
from hypothesis import HealthCheck, given, settings
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


# -- the consume path on the real server: shortcut vs plain twin ---------------------

_STEPS = ["ok", "fail", "retry", "reject", "slow"]


def _run_schedule(url: str, topic: str, group: str, steps: list[str], stop_after: int,
                  plain: bool) -> dict[str, Any]:
    """Publish one message per step, consume them with a Consumer (stopped and started
    again after ``stop_after`` handler calls) until every one is handled or dead, and
    return what happened to each."""
    from msgpatterns import Backoff, Consumer, NeedRetry, Reject, RetryPolicy

    broker = RabbitMQBroker(url, prefetch=16, queue_type="quorum")
    if plain:  # the plain twin builds every Message
        broker._message = RabbitMQBroker._message_plain  # type: ignore[method-assign]
    calls: list[tuple[int, int]] = []  # (message, attempt) per handler call
    handled: list[tuple[int, int, str | None]] = []  # (message, attempt, id) that succeeded
    lock = threading.Lock()
    stop_now = threading.Event()

    def handler(message: Message) -> None:
        i = int(message.raw_body)
        step = steps[i]
        with lock:
            calls.append((i, message.attempt))
            if len(calls) >= stop_after:
                stop_now.set()
        if step == "reject":
            raise Reject("never")
        if step == "fail" and message.attempt == 1:
            raise ValueError("first attempt fails")
        if step == "retry" and message.attempt == 1:
            raise NeedRetry(0.0)
        if step == "slow":
            threading.Event().wait(0.05)  # work that takes a while
        with lock:
            handled.append((i, message.attempt, message.id))

    policy = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.0), local_retries=0)

    def consumer() -> Any:
        return Consumer(broker, handler, topics=[topic], group=group, workers=2,
                        max_in_flight=8, poll_timeout=0.05, retry=policy)

    try:
        broker.subscribe(topic, group)
        ids = broker.publish_many(topic, [str(i).encode() for i in range(len(steps))])
        first = consumer()
        first.start()
        stop_now.wait(30)
        first.stop(10)
        second = consumer()
        second.start()
        expected = sum(step != "reject" for step in steps)
        give_up = threading.Event()
        for _ in range(600):
            with lock:
                if len({i for i, _, _ in handled}) >= expected:
                    break
            give_up.wait(0.05)
        second.stop(10)
        dead = broker.dead_letter_admin().list_dead_letters(topic, group)
    finally:
        broker.close()
    return {
        "handled": sorted((i, attempt, mid == ids[i]) for i, attempt, mid in handled),
        "dead": sorted(int(record.message.raw_body) for record in dead),
        "ids_kept": all(record.message.id == ids[int(record.message.raw_body)]
                        for record in dead),
    }


@pytest.mark.rabbitmq
@pytest.mark.timeout(600)
@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # a URL string
@given(steps=st.lists(st.sampled_from(_STEPS), min_size=3, max_size=7),
       stop=st.integers(1, 6))
def test_consume_path_matches_the_plain_twin_on_generated_schedules(
    rabbitmq_url: str, steps: list[str], stop: int
) -> None:
    import uuid

    outcomes = []
    for plain in (False, True):
        topic, group = f"fpd-{uuid.uuid4().hex[:10]}", "g"
        try:
            outcomes.append(_run_schedule(rabbitmq_url, topic, group, steps,
                                          min(stop, len(steps)), plain))
        finally:
            delete_rabbitmq_topology(rabbitmq_url, topic, group)
    fast, plain_run = outcomes
    # Both are what the schedule says: each message's effect exactly once, on the
    # attempt the schedule allows; rejects dead-lettered; ids kept throughout. The
    # attempt may run one ahead for a message on the wire when the first consumer
    # stopped: a quorum queue counts that delivery (docs/brokers.md), on either path.
    want = sorted((i, 2 if step in ("fail", "retry") else 1)
                  for i, step in enumerate(steps) if step != "reject")
    for run in (fast, plain_run):
        assert [(i, kept) for i, _, kept in run["handled"]] == [(i, True) for i, _ in want]
        for (_, attempt, _), (_, allowed) in zip(run["handled"], want, strict=True):
            assert allowed <= attempt <= allowed + 1
        assert run["dead"] == [i for i, step in enumerate(steps) if step == "reject"]
        assert run["ids_kept"]
