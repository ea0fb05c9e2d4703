"""The Redis Streams adapter, regressions from the outside (first collected in issue
10): entries written by ``redis-cli`` (a foreign client), the docs' order of calls
(``consumer.stop()`` then ``broker.close()``), ``XPENDING``/``XINFO``/``CLIENT LIST`` as
the server reports them, and a redis-server of the test's own, killed with SIGKILL and
restarted."""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_harness import eventually, require_library
from msgpatterns import Consumer, DeadLetter, Message, RetryPolicy
from msgpatterns.errors import BrokerClosed, BrokerError, BrokerUnavailable

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

GROUP = "g"


@pytest.fixture
def client(redis_url: str) -> Iterator[Any]:
    require_library("redis", "RedisStreamsBroker")
    import redis

    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def stream(client: Any) -> Iterator[str]:
    name = f"rreg-{uuid.uuid4().hex[:10]}"
    yield name
    keys = list(client.scan_iter(match=f"{name}*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def cli(redis_url: str) -> Callable[..., str]:
    """``redis-cli`` against the shared server: ``cli("XADD", s, "*", "body", "x")``,
    or ``cli(script="...")`` to run one command per line (escapes like ``"\\xff"``)."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    return _cli_for(redis_url)


def _cli_for(url: str) -> Callable[..., str]:
    def run(*args: str, script: str | None = None) -> str:
        done = subprocess.run(["redis-cli", "-u", url, *args], input=script,
                              capture_output=True, text=True, timeout=30, check=True)
        return done.stdout.strip()
    return run


def broker_for(url: str, **kwargs: Any) -> Any:
    from msgpatterns.brokers import RedisStreamsBroker

    return RedisStreamsBroker(url, **kwargs)


def named_url(redis_url: str, name: str) -> str:
    """The URL with a client name, so CLIENT LIST shows this broker's connections."""
    return f"{redis_url}{'&' if '?' in redis_url else '?'}client_name={name}"


def connections(client: Any, name: str) -> list[dict[str, Any]]:
    return [c for c in client.client_list() if c.get("name") == name]


def pending(client: Any, stream: str, group: str = GROUP) -> int:
    return int(client.xpending(stream, group)["pending"])


def record(message: Message) -> DeadLetter:
    return DeadLetter.from_error(message, ValueError("boom"), now=time.time())


def run_consumer(broker: Any, stream: str, handler: Callable[[Message], None],
                 until: Callable[[], bool]) -> None:
    """The docs' order: start, wait for ``until``, ``stop()`` then ``broker.close()``."""
    consumer = Consumer(broker, handler, topics=[stream], group=GROUP, workers=2,
                        poll_timeout=0.05, retry=RetryPolicy(max_attempts=1))
    consumer.start()
    try:
        eventually(until, timeout=20, message="the consumer's work")
    finally:
        consumer.stop(5)
        broker.close()


# -- hole 1 and 5: lifecycle ------------------------------------------------------------


def test_stop_then_close_flushes_acks_and_every_operation_is_refused(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str
) -> None:
    """Hole 1: with stop() then close(), queued acks reach Redis (XPENDING is empty),
    the closed broker holds no connection, and fetch, ack, nack, publish and
    dead_letter raise BrokerClosed at once without reconnecting."""
    name = f"rreg-{uuid.uuid4().hex[:8]}"
    broker = broker_for(named_url(redis_url, name), ack_flush_interval=60)  # acks queued
    cli(script="".join(f"XADD {stream} * body m{i}\n" for i in range(10)))
    seen: list[Message] = []
    run_consumer(broker, stream, seen.append, lambda: len(seen) == 10)
    assert pending(client, stream) == 0  # close() sent the queued acks
    assert connections(client, name) == []
    m = seen[0]
    for call in (lambda: broker.fetch([stream], GROUP, 1, 0.0), lambda: broker.ack(m),
                 lambda: broker.nack(m, 0.0), lambda: broker.publish(stream, b"late"),
                 lambda: broker.dead_letter(m, record(m)), lambda: broker.flush()):
        with pytest.raises(BrokerClosed):
            call()
    assert connections(client, name) == []  # nothing reconnected
    assert client.xlen(stream) == 10
    broker.close()  # idempotent


def test_close_fails_loudly_when_queued_acks_cannot_be_sent(
    client: Any, stream: str, redis_url: str
) -> None:
    """Hole 1: close() raises BrokerError (the cause kept) when the queued acks are
    refused, still releases the broker, and then refuses everything."""
    broker = broker_for(redis_url, ack_flush_interval=60)
    broker.publish(stream, b"x")
    [m] = broker.fetch([stream], GROUP, 1, timeout=0.5)
    broker.ack(m)  # queued
    client.delete(stream)
    client.set(stream, "not a stream any more")  # XACK now answers WRONGTYPE
    with pytest.raises(BrokerError) as caught:
        broker.close()
    assert "WRONGTYPE" in str(caught.value.__cause__)
    with pytest.raises(BrokerClosed):
        broker.fetch([stream], GROUP, 1, 0.0)
    broker.close()  # idempotent, and quiet the second time


def _race_close_against_a_publish(client: Any, redis_url: str, topic: str) -> None:
    """One round: a fetch blocked in XREADGROUP, an entry added while close() runs.
    Whether the fetch returned it before close() or not, close() leaves nothing pending
    under the closed consumer: an entry returned and not settled before close() is handed
    back (its settlement would be refused after close), so the group reads it exactly
    once more, its attempt unchanged; an entry nobody read stays for the group."""
    name = f"rreg-{uuid.uuid4().hex[:8]}"
    broker = broker_for(named_url(redis_url, name))
    broker.subscribe(topic, GROUP)
    results: list[Any] = []

    def fetch() -> None:
        try:
            results.append(broker.fetch([topic], GROUP, 10, timeout=30))
        except BrokerClosed:
            results.append([])

    fetcher = threading.Thread(target=fetch)
    fetcher.start()
    eventually(lambda: any("b" in c["flags"] for c in connections(client, name)),
               message="the fetch blocked in XREADGROUP")
    adder = threading.Thread(target=client.xadd, args=(topic, {"body": b"racer"}))
    adder.start()
    broker.close()
    adder.join()
    fetcher.join(10)
    assert not fetcher.is_alive() and connections(client, name) == []
    got = results[0]
    owners = {c["name"]: int(c["pending"]) for c in client.xinfo_consumers(topic, GROUP)}
    assert {k: v for k, v in owners.items() if v} == {}, owners
    with broker_for(redis_url) as survivor:
        rest = survivor.fetch([topic], GROUP, 10, timeout=0.2)
        assert [m.raw_body for m in rest] == [b"racer"]  # the group reads it once
        if got:  # returned before close(), handed back by it: same message, same attempt
            assert [(m.id, m.attempt) for m in got] == [(m.id, m.attempt) for m in rest]
        for m in rest:
            survivor.ack(m)
    assert pending(client, topic) == 0
    assert pending(client, f"{topic}:retry:{GROUP}") == 0


def test_close_wakes_a_blocked_fetch_which_reads_nothing_afterwards(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str
) -> None:
    """Hole 1: a fetch blocked in XREADGROUP while close() runs in another thread ends
    (BrokerClosed) instead of retrying on a new connection; what is published after
    close() is read by nobody, and no entry stays pending under the closed consumer;
    an entry added while close() runs is delivered once, never stranded."""
    name = f"rreg-{uuid.uuid4().hex[:8]}"
    broker = broker_for(named_url(redis_url, name))
    broker.subscribe(stream, GROUP)
    outcome: list[Any] = []

    def fetch() -> None:
        try:
            outcome.append(broker.fetch([stream], GROUP, 10, timeout=30))
        except BaseException as exc:  # the test inspects it
            outcome.append(exc)

    fetcher = threading.Thread(target=fetch)
    fetcher.start()
    eventually(lambda: any("b" in c["flags"] for c in connections(client, name)),
               message="the fetch blocked in XREADGROUP")
    broker.close()
    cli("XADD", stream, "*", "body", "after-close")
    fetcher.join(10)
    assert not fetcher.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], BrokerClosed), outcome
    assert connections(client, name) == []
    assert pending(client, stream) == 0
    assert client.xinfo_groups(stream)[0]["lag"] == 1  # the late entry is unread
    for round_ in range(3):  # and racing a publish, from the server's side
        _race_close_against_a_publish(client, redis_url, f"{stream}-{round_}")


def test_publish_after_close_raises_broker_closed(
    client: Any, stream: str, redis_url: str
) -> None:
    """Hole 5: publish() after close() raises BrokerClosed and writes nothing."""
    with broker_for(redis_url) as broker:
        broker.publish(stream, b"before")
    with pytest.raises(BrokerClosed):
        broker.publish(stream, b"after")
    assert client.xlen(stream) == 1


# -- hole 2: identity ---------------------------------------------------------------------


def test_ids_are_unique_across_streams_and_stable_across_redeliveries(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str
) -> None:
    """Hole 2: two streams with the same entry id (redis-cli XADD with an explicit id)
    give two different message ids; a nack, a delayed retry and a claim after the
    visibility timeout all keep the id; the dead letter carries it too."""
    a, b = f"{stream}-a", f"{stream}-b"
    cli("XADD", a, "1-1", "body", "x")
    cli("XADD", b, "1-1", "body", "y")
    broker = broker_for(redis_url, visibility_timeout=0.05, claim_interval=0.01)
    try:
        first = broker.fetch([a, b], GROUP, 10, timeout=0.5)
        ids = {m.raw_body: m.id for m in first}
        assert len(set(ids.values())) == 2, ids
        mx = next(m for m in first if m.raw_body == b"x")
        original = mx.id
        broker.nack(mx, 0.0)
        [retry] = broker.fetch([a], GROUP, 10, timeout=0.5)
        assert retry.id == original and retry.attempt == 2
        broker.nack(retry, 0.01)  # the delayed path: sorted set, then the retry stream
        [delayed] = eventually(lambda: broker.fetch([a], GROUP, 10, timeout=0.1))
        assert delayed.id == original and delayed.attempt == 3
        # Not settled: after the visibility timeout it is claimed again, same id.
        [claimed] = eventually(lambda: broker.fetch([a], GROUP, 10, timeout=0.1))
        assert claimed.id == original and claimed.attempt == 4
        broker.dead_letter(claimed, record(claimed))
        [dead] = broker.list_dead_letters(a, GROUP)
        assert dead.id == original
        for m in first:
            if m.raw_body == b"y":
                broker.ack(m)
        broker.flush()
        assert pending(client, a) == pending(client, b) == 0
    finally:
        broker.close()
        client.delete(a, b, f"{a}:retry:{GROUP}", f"{b}:retry:{GROUP}", f"{a}:dlq",
                      f"{a}:delayed:{GROUP}")


# -- hole 6: reclaiming a dead consumer's backlog ------------------------------------------


def test_a_dead_consumers_backlog_is_reclaimed_at_the_fetch_rate(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str
) -> None:
    """Hole 6: 600 entries left pending by a dead consumer (read with redis-cli) are
    all claimed within a bounded number of fetches once stale, not one batch per
    claim_interval (an hour here)."""
    total, batch = 600, 64
    cli("XGROUP", "CREATE", stream, GROUP, "0", "MKSTREAM")
    cli(script="".join(f"XADD {stream} * body {i}\n" for i in range(total)))
    cli("XREADGROUP", "GROUP", GROUP, "dead", "COUNT", str(total), "STREAMS", stream, ">")
    assert pending(client, stream) == total
    broker = broker_for(redis_url, visibility_timeout=0.05, claim_interval=3600,
                        ack_flush_interval=0)
    try:
        eventually(lambda: len(client.xpending_range(stream, GROUP, "-", "+", total,
                                                     idle=50)) == total,
                   message="the orphans are stale")
        handled: Counter[bytes] = Counter()
        fetches = 0
        while sum(handled.values()) < total and fetches < 50:
            fetches += 1
            for m in broker.fetch([stream], GROUP, batch, timeout=0):
                handled[m.raw_body] += 1
                broker.ack(m)
        assert sum(handled.values()) == total and set(handled.values()) == {1}
        assert fetches <= math.ceil(total / batch) + 2, fetches
        assert pending(client, stream) == 0
    finally:
        broker.close()


# -- hole 15: a lost consumer group -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    import redis

    probe = redis.Redis(port=port, socket_connect_timeout=0.5)

    def up() -> bool:
        try:
            return bool(probe.ping())
        except redis.ConnectionError:
            assert proc.poll() is None, "redis-server exited"
            return False

    try:
        eventually(up, timeout=10, message="redis-server accepting connections")
    finally:
        probe.close()
    return proc


def test_a_restarted_redis_without_persistence_is_consumed_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hole 15: consume, kill -9 our own redis-server (no persistence), restart it on
    the same port empty, publish with redis-cli: the group is re-created and the new
    message consumed; the loss is logged."""
    require_library("redis", "RedisStreamsBroker")
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli not installed")
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cli = _cli_for(url)
    server = _start_server(port, tmp_path)
    broker = broker_for(url, ack_flush_interval=0)
    try:
        cli("XADD", "orders", "*", "body", "before")
        [m] = eventually(lambda: broker.fetch(["orders"], GROUP, 10, timeout=0.1))
        broker.ack(m)
        server.send_signal(signal.SIGKILL)
        server.wait()
        server = _start_server(port, tmp_path)
        cli("XADD", "orders", "*", "body", "after")
        with caplog.at_level(logging.ERROR, logger="msgpatterns.brokers.redis"):
            [again] = eventually(lambda: broker.fetch(["orders"], GROUP, 10, timeout=0.1))
        assert again.raw_body == b"after"
        broker.ack(again)
        assert cli("XPENDING", "orders", GROUP).splitlines()[0] == "0"
        assert any("was lost" in r.getMessage() for r in caplog.records)
    finally:
        broker.close()
        server.send_signal(signal.SIGKILL)
        server.wait()


def test_a_destroyed_group_is_recreated_and_consumption_resumes(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Hole 15: XGROUP DESTROY (redis-cli) under a running broker: the next fetch
    re-creates the group, logs the loss, and the entry published afterwards is
    consumed; nothing is lost (entries still in the stream are read again)."""
    broker = broker_for(redis_url, ack_flush_interval=0)
    try:
        cli("XADD", stream, "*", "body", "one")
        [m] = broker.fetch([stream], GROUP, 10, timeout=0.5)
        broker.ack(m)
        cli("XGROUP", "DESTROY", stream, GROUP)
        cli("XADD", stream, "*", "body", "two")
        with caplog.at_level(logging.ERROR, logger="msgpatterns.brokers.redis"):
            got = broker.fetch([stream], GROUP, 10, timeout=0.5)
        assert b"two" in [g.raw_body for g in got]
        for g in got:
            broker.ack(g)
        assert pending(client, stream) == 0
        assert any("was lost" in r.getMessage() for r in caplog.records)
    finally:
        broker.close()


# -- hole 16 and fuzzed input: one bad entry never stalls the rest --------------------------


def _dead_letters(broker_url: str, stream: str) -> list[DeadLetter]:
    with broker_for(broker_url) as admin:
        return list(admin.list_dead_letters(stream, GROUP))


def test_an_undecodable_field_name_dead_letters_that_entry_only(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str
) -> None:
    """Hole 16: 20 good entries and one whose field name is b"\\xff\\xfe" (redis-cli):
    the 20 are handled exactly once, the bad one is in <stream>:dlq with its raw fields
    and a reason, XPENDING is empty."""
    lines = [f"XADD {stream} * body good{i}" for i in range(20)]
    lines.insert(10, f'XADD {stream} * "\\xff\\xfe" "v\\x80"')
    cli(script="\n".join(lines) + "\n")
    handled: Counter[bytes] = Counter()
    lock = threading.Lock()

    def handler(m: Message) -> None:
        with lock:
            handled[m.raw_body] += 1

    run_consumer(broker_for(redis_url), stream, handler,
                 lambda: sum(handled.values()) == 20 and client.xlen(f"{stream}:dlq") == 1)
    assert set(handled) == {f"good{i}".encode() for i in range(20)}
    assert set(handled.values()) == {1}
    assert pending(client, stream) == 0
    [dead] = _dead_letters(redis_url, stream)
    assert "not UTF-8" in dead.reason
    [[name, value]] = json.loads(dead.message.raw_body)
    assert name.encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert value.encode("utf-8", "surrogateescape") == b"v\x80"


def test_hostile_bodies_and_keys_are_consumed_exactly_once(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str
) -> None:
    """Fuzz: bodies not UTF-8, empty and 1 MB (redis-cli and the adapter), keys with
    NUL, quotes, glob and hash-tag syntax: each consumed exactly once, intact."""
    cli(script=f'XADD {stream} * body "\\xff\\x00\\xfe"\nXADD {stream} * body ""\n')
    keys = ["a\x00b", "it's \"quoted\"", "*?[glob]", "{tag}", "{", "}{", "x" * 10_000]
    big = bytes(range(256)) * 4096
    with broker_for(redis_url) as publisher:
        for k in keys:
            publisher.publish(stream, k.encode("utf-8"), key=k)
        publisher.publish(stream, big)
    seen: list[Message] = []
    lock = threading.Lock()

    def handler(m: Message) -> None:
        with lock:
            seen.append(m)

    total = 2 + len(keys) + 1
    run_consumer(broker_for(redis_url), stream, handler, lambda: len(seen) == total)
    bodies = Counter(m.raw_body for m in seen)
    assert bodies == Counter([b"\xff\x00\xfe", b"", big, *(k.encode() for k in keys)])
    assert {m.key for m in seen if m.key is not None} == set(keys)
    assert all(m.raw_body == m.key.encode() for m in seen if m.key is not None)
    assert len({m.id for m in seen}) == total
    assert pending(client, stream) == 0 and not client.exists(f"{stream}:dlq")


@pytest.mark.parametrize("headers", [
    "not json",
    "[1, 2]",
    '{"x-msgpatterns-attempt": 3}',
    '{"x-msgpatterns-attempt": "abc"}',
    '{"x-msgpatterns-attempt": "0"}',
    '{"x-msgpatterns-timestamp": "nan"}',
    '{"x-msgpatterns-key": {"nested": 1}}',
    '{"user": null}',
])
def test_wrongly_typed_headers_dead_letter_that_message_with_a_reason(
    client: Any, cli: Callable[..., str], stream: str, redis_url: str, headers: str
) -> None:
    """Fuzz: a foreign entry whose headers field is not a JSON object of strings, or
    whose library header has the wrong type, is dead-lettered with a reason; the
    entry after it is consumed; nothing stays pending."""
    cli("XADD", stream, "*", "body", "bad", "headers", headers)
    cli("XADD", stream, "*", "body", "good")
    seen: list[bytes] = []
    run_consumer(broker_for(redis_url), stream, lambda m: seen.append(m.raw_body),
                 lambda: seen == [b"good"] and client.xlen(f"{stream}:dlq") == 1)
    assert pending(client, stream) == 0
    [dead] = _dead_letters(redis_url, stream)
    assert "header" in dead.reason and dead.error_type.endswith("MalformedMessage")


# -- errors: no redis-py exception escapes bare -------------------------------------------


def test_an_unreachable_server_raises_broker_unavailable_with_the_cause() -> None:
    """Errors: a connection failure that outlasts the reconnect attempts is
    BrokerUnavailable (a BrokerError), with redis-py's error as the cause."""
    require_library("redis", "RedisStreamsBroker")
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(port=_free_port(), socket_connect_timeout=0.5,
                       retry=Retry(NoBackoff(), 0))
    with broker_for_client(dead) as broker:
        with pytest.raises(BrokerUnavailable) as caught:
            broker.publish("nowhere", b"x")
        assert isinstance(caught.value.__cause__, redis.ConnectionError)
        with pytest.raises(BrokerError):
            broker.fetch(["nowhere"], GROUP, 1, 0.0)


def test_refused_credentials_fail_at_once_without_retrying(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Errors: an authentication failure is BrokerUnavailable at once, never retried
    as if it were transient."""
    require_library("redis", "RedisStreamsBroker")
    import redis

    url = redis_url.replace("redis://", f"redis://ghost-{uuid.uuid4().hex[:6]}:pw@", 1)
    with (caplog.at_level(logging.WARNING, logger="msgpatterns.brokers.redis"),
          broker_for(url) as broker, pytest.raises(BrokerUnavailable) as caught):
        broker.publish("nowhere", b"x")
    assert isinstance(caught.value.__cause__, redis.AuthenticationError)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def broker_for_client(client: Any, **kwargs: Any) -> Any:
    from msgpatterns.brokers import RedisStreamsBroker

    return RedisStreamsBroker(client, **kwargs)


# -- issue 21: an ordered topic's partitions moved under a backlog ---------------------


def _read_ahead_on(broker: Any, topics: list[str], count: int) -> list[Message]:
    """Full fetches in a row (a backlog, steady): a read of both streams brings twice
    ``count`` (the surplus waits for the next fetch), and the third sends a read-ahead."""
    got: list[Message] = []
    for _ in range(3):
        got += broker.fetch(topics, GROUP, max_messages=count, timeout=0)
    assert len(got) == 3 * count
    pending = sum(broker._redis.xpending(t, GROUP)["pending"] for t in topics)
    assert pending >= 5 * count  # a surplus and a read-ahead wait in this broker
    return got


def test_a_read_ahead_for_streams_no_longer_asked_for_is_handed_back_at_once(
        redis_url: str, client: Any, stream: str) -> None:
    """A consumer read ahead from two streams, then asks for one only (its ordered
    topic's partition went to another member): what it read ahead of the other stream
    is handed back by that fetch, so the stream's next reader gets those entries first
    and in order - not after ``read_ahead_hold`` (or a visibility timeout), behind
    later entries. It broke per-key order on Redis under a backlog."""
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    a, b = f"{stream}-a", f"{stream}-b"
    one = RedisStreamsBroker(redis_url, consumer="one", read_ahead_hold=60)
    two = RedisStreamsBroker(redis_url, consumer="two")
    try:
        for i in range(40):
            one.publish(a, str(i).encode())
            one.publish(b, str(i).encode())
        got = _read_ahead_on(one, [a, b], 4)
        taken_b = [int(m.raw_body) for m in got if m.topic == b]
        one.ack_many(got)
        one.fetch([a], GROUP, max_messages=4, timeout=0)  # b is not asked for any more
        rest = [int(m.raw_body) for m in two.fetch([b], GROUP, max_messages=100, timeout=0)]
        assert taken_b + rest == list(range(40))  # b's entries in order, none skipped
    finally:
        one.close()
        two.close()
        client.delete(f"{stream}-a", f"{stream}-b")


def test_hand_back_unfetched_returns_a_partitions_read_ahead_before_it_is_given_up(
        redis_url: str, client: Any, stream: str) -> None:
    """:meth:`RedisStreamsBroker.hand_back_unfetched` (what an ordered topic's feed
    calls before it releases a partition) hands back the read-ahead and the surplus
    of those streams now; the entries of the others stay first in line."""
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    a, b = f"{stream}-a", f"{stream}-b"
    one = RedisStreamsBroker(redis_url, consumer="one", read_ahead_hold=60)
    two = RedisStreamsBroker(redis_url, consumer="two")
    try:
        for i in range(40):
            one.publish(a, str(i).encode())
            one.publish(b, str(i).encode())
        got = _read_ahead_on(one, [a, b], 4)
        one.ack_many(got)
        assert one.hand_back_unfetched([b], GROUP) > 0
        taken_b = [int(m.raw_body) for m in got if m.topic == b]
        rest = [int(m.raw_body) for m in two.fetch([b], GROUP, max_messages=100, timeout=0)]
        assert taken_b + rest == list(range(40))
        taken_a = [int(m.raw_body) for m in got if m.topic == a]
        more_a = [int(m.raw_body) for m in one.fetch([a, b], GROUP, max_messages=100,
                                                      timeout=0) if m.topic == a]
        assert taken_a + more_a == list(range(40))  # a's read-ahead kept its place
    finally:
        one.close()
        two.close()
        client.delete(f"{stream}-a", f"{stream}-b")
