"""NatsJetStreamBroker on the real NATS server, tried as a stranger would: messages from
a foreign publisher (plain nats-py, no msgpatterns headers), hostile headers, close()
racing acks, an unreachable server, and a server the test starts, kills and restarts.
The conformance suite (tests/test_conformance.py) covers the Broker contract."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from broker_harness import delete_nats_stream, drain, eventually, require_library
from msgpatterns import Consumer, Message, RetryPolicy
from msgpatterns.errors import BrokerClosed, BrokerUnavailable, ConfigurationError
from msgpatterns.testing import services

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]


@pytest.fixture
def nats_url() -> str:
    require_library("nats", "NatsJetStreamBroker")
    return services.require("nats")


@pytest.fixture
def topic(nats_url: str, unique: str) -> Iterator[str]:
    name = f"nats-{unique}"
    yield name
    delete_nats_stream(nats_url, name)


def foreign_publish(url: str, subject: str, bodies: list[bytes],
                    headers: dict[str, str] | None = None) -> list[int]:
    """Publish with plain nats-py (what another team's service would do); returns the
    stream sequences."""
    import nats

    async def publish() -> list[int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            acks = [await js.publish(subject, body, headers=headers) for body in bodies]
            return [ack.seq for ack in acks]
        finally:
            await nc.close()

    return asyncio.run(publish())


def consumer_state(url: str, topic: str, durable: str) -> tuple[int, int]:
    """(num_pending, num_ack_pending) of a durable consumer, read by plain nats-py."""
    import nats

    from msgpatterns.brokers import NatsJetStreamBroker

    async def read() -> tuple[int, int]:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info(NatsJetStreamBroker.stream_name(topic),
                                                      durable)
            return info.num_pending, info.num_ack_pending
        finally:
            await nc.close()

    return asyncio.run(read())


def test_foreign_messages_get_stable_unique_ids_and_are_consumed_once(
    nats_url: str, topic: str
) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    with NatsJetStreamBroker(nats_url, visibility_timeout=2.0) as broker:
        broker.subscribe(topic, "billing")  # the stream exists before the foreign publish
        foreign_publish(nats_url, topic, [f"m{i}".encode() for i in range(40)])
        seen: dict[bytes, list[str | None]] = {}
        lock = threading.Lock()

        def handler(message: Message) -> None:
            with lock:
                seen.setdefault(message.raw_body, []).append(message.id)
            if message.raw_body == b"m7" and message.attempt == 1:
                raise RuntimeError("fails once")  # the retry must keep its id

        consumer = Consumer(broker, handler, topics=[topic], group="billing", workers=4,
                            poll_timeout=0.05,
                            retry=RetryPolicy(local_retries=0, backoff=0.05))
        consumer.start()
        try:
            eventually(lambda: len(seen) == 40 and len(seen[b"m7"]) == 2)
        finally:
            assert consumer.stop(5)
    ids = [ids[0] for ids in seen.values()]
    assert len(set(ids)) == 40  # unique across messages
    assert all(i is not None and i.startswith(NatsJetStreamBroker.stream_name(topic))
               for i in ids)
    assert seen[b"m7"][0] == seen[b"m7"][1]  # stable across the retry
    assert all(len(v) == 1 for k, v in seen.items() if k != b"m7")
    assert consumer_state(nats_url, topic, "billing") == (0, 0)  # nothing left behind


def test_hostile_headers_are_data(nats_url: str, topic: str) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    with NatsJetStreamBroker(nats_url) as broker:
        broker.subscribe(topic, "g")
        foreign_publish(nats_url, topic, [b"a"], headers={
            "x-msgpatterns-key": "k\x00'\"*{tag}", "plain": "v"})
        [message] = drain(broker, topic, "g", count=1)
        assert message.attempt == 1
        assert message.key == "k\x00'\"*{tag}"
        assert message.headers["plain"] == "v"
        broker.ack(message)


def test_close_flushes_acks_and_then_refuses_everything(nats_url: str, topic: str) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    broker = NatsJetStreamBroker(nats_url)
    for i in range(50):
        broker.publish(topic, f"{i}".encode())
    got = drain(broker, topic, "g", count=50, batch=50)
    for message in got:
        broker.ack(message)
    broker.close()  # right after the acks: they are sent before the connection goes
    assert consumer_state(nats_url, topic, "g") == (0, 0)
    for call in (lambda: broker.publish(topic, b"x"),
                 lambda: broker.fetch([topic], "g"),
                 lambda: broker.ack(got[0]),
                 lambda: broker.nack(got[0], 1.0),
                 lambda: broker.list_dead_letters(topic)):
        with pytest.raises(BrokerClosed):
            call()
    broker.close()  # idempotent


def test_stop_then_close_in_the_documented_order_loses_nothing(
    nats_url: str, topic: str
) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    broker = NatsJetStreamBroker(nats_url, visibility_timeout=1.0)
    for i in range(200):
        broker.publish(topic, f"{i}".encode())
    handled: list[bytes] = []
    consumer = Consumer(broker, lambda m: handled.append(m.raw_body), topics=[topic],
                        group="g", workers=2, poll_timeout=0.05)
    consumer.start()
    eventually(lambda: len(handled) >= 50)
    consumer.stop(5)
    broker.close()
    # A second consumer finishes the rest; nothing is lost, duplicates only for what
    # was handed back (unsettled) at the stop.
    with NatsJetStreamBroker(nats_url, visibility_timeout=1.0) as again:
        rest = Consumer(again, lambda m: handled.append(m.raw_body), topics=[topic],
                        group="g", poll_timeout=0.05)
        rest.start()
        try:
            eventually(lambda: {int(b) for b in handled} == set(range(200)))
        finally:
            rest.stop(5)
    assert consumer_state(nats_url, topic, "g") == (0, 0)


def test_unreachable_server_fails_fast_with_a_typed_error() -> None:
    require_library("nats", "NatsJetStreamBroker")
    from msgpatterns.brokers import NatsJetStreamBroker

    with pytest.raises(BrokerUnavailable, match=r"127\.0\.0\.1:1"):
        NatsJetStreamBroker("nats://127.0.0.1:1", connect_timeout=1.0)


@pytest.mark.parametrize("bad", ["orders.*", "orders.>", "has space", "", "a..b",
                                 "orders.__dlq"])
def test_topics_that_are_not_plain_subjects_are_refused(nats_url: str, bad: str) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    with NatsJetStreamBroker(nats_url) as broker, pytest.raises(ConfigurationError):
        broker.publish(bad, b"x")


def test_dead_letters_list_replay_and_purge(nats_url: str, topic: str) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    with NatsJetStreamBroker(nats_url) as broker:
        broker.publish(topic, b"poison", key="p1")
        broker.publish(topic, b"poison", key="p2")
        consumer = Consumer(broker, _reject, topics=[topic], group="g", poll_timeout=0.05)
        consumer.start()
        try:
            eventually(lambda: len(broker.list_dead_letters(topic, "g")) == 2)
        finally:
            consumer.stop(5)
        records = broker.list_dead_letters(topic)
        assert {r.message.key for r in records} == {"p1", "p2"}
        assert all("rejected" in r.reason for r in records)
        assert broker.list_dead_letters(topic, "other-group") == []
        p1 = next(r for r in records if r.message.key == "p1")
        assert broker.replay_dead_letters(topic, "g", ids=[p1.id or ""]) == 1
        [replayed] = drain(broker, topic, "g", count=1)
        assert (replayed.key, replayed.attempt, replayed.id) == ("p1", 1, p1.id)
        broker.ack(replayed)
        assert broker.purge_dead_letters(topic) == 1
        assert broker.list_dead_letters(topic) == []


def _reject(message: Message) -> None:
    from msgpatterns import Reject

    raise Reject("never valid")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_nats(port: int, store: Path) -> subprocess.Popen[bytes]:
    server = shutil.which("nats-server") or "/usr/sbin/nats-server"
    proc = subprocess.Popen([server, "-a", "127.0.0.1", "-p", str(port), "-js",
                             "-sd", str(store)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    eventually(lambda: _accepts(port), message="nats-server listening")
    return proc


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_a_killed_and_restarted_server_loses_nothing(tmp_path: Path, unique: str) -> None:
    """A NATS node the test owns is SIGKILLed mid-stream and restarted on the same
    store: the consumer reconnects by itself and every message is handled."""
    require_library("nats", "NatsJetStreamBroker")
    if not (shutil.which("nats-server") or Path("/usr/sbin/nats-server").exists()):
        if services.services_required():
            pytest.fail("MSGPATTERNS_REQUIRE_SERVICES=1 but nats-server is not installed")
        pytest.skip("nats-server is not installed")
    from msgpatterns.brokers import NatsJetStreamBroker

    port = _free_port()
    url = f"nats://127.0.0.1:{port}"
    proc = _start_nats(port, tmp_path)
    topic = f"restart-{unique}"
    handled: set[bytes] = set()
    lock = threading.Lock()
    half = threading.Event()

    def handler(message: Message) -> None:
        with lock:
            handled.add(message.raw_body)
            if len(handled) >= 100:
                half.set()

    broker: Any = NatsJetStreamBroker(url, visibility_timeout=1.0)
    try:
        for i in range(300):
            broker.publish(topic, f"{i}".encode())
        consumer = Consumer(broker, handler, topics=[topic], group="g", poll_timeout=0.05)
        consumer.start()
        try:
            assert half.wait(20)
            proc.kill()
            proc.wait()
            proc = _start_nats(port, tmp_path)
            eventually(lambda: len(handled) == 300, timeout=30)
        finally:
            consumer.stop(5)
    finally:
        try:
            broker.close()
        finally:
            proc.kill()
            proc.wait()
    assert handled == {f"{i}".encode() for i in range(300)}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run([sys.executable, "-m", "msgpatterns", *args],
                          capture_output=True, text=True, timeout=20)


def test_dlq_cli_on_nats_unreachable_is_one_line_and_a_typo_warns(
    nats_url: str, topic: str
) -> None:
    down = _cli("dlq", "list", "nats://u:s3cret@127.0.0.1:1", "--topic", "orders")
    assert down.returncode == 1 and "Traceback" not in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1 and "s3cret" not in down.stderr
    from msgpatterns.brokers import NatsJetStreamBroker

    with NatsJetStreamBroker(nats_url) as broker:
        broker.publish(topic, b"x")
    known = _cli("dlq", "list", nats_url, "--topic", topic)
    assert known.returncode == 0 and known.stderr == "", known.stderr
    typo = _cli("dlq", "list", nats_url, "--topic", f"{topic}-typo")
    assert typo.returncode == 0 and "warning: no topic" in typo.stderr
    with NatsJetStreamBroker(nats_url) as broker:
        assert not broker.has_topic(f"{topic}-typo")  # listing never created it


def test_the_ack_ledger_keeps_an_ack_until_an_echo_on_its_connection_confirms_it() -> None:
    """Issue 19: acks written as the connection died were lost and never sent again
    (their deliveries waited for ack_wait, effects applied). The ledger keeps each ack
    with its payload and connection; an echo that came back on the same connection
    confirms what was sent before it; acks of a connection that is gone are sent again,
    NAKs as NAKs (resending one as an ack would lose the message)."""
    from msgpatterns.brokers.nats._acks import AckLedger

    ledger = AckLedger()
    ledger.sent("$JS.ACK.a", 0)
    ledger.sent("$JS.ACK.b", 0, b"-NAK")
    before = ledger.snapshot()
    ledger.sent("$JS.ACK.c", 0)  # after the echo went out: not confirmed by it
    ledger.confirmed(before, 0, 1)  # the connection changed meanwhile: nothing
    assert len(ledger) == 3
    assert sorted(ledger.to_resend(1)) == [("$JS.ACK.a", b""), ("$JS.ACK.b", b"-NAK"),
                                           ("$JS.ACK.c", b"")]
    for reply, payload in ledger.to_resend(1):
        ledger.sent(reply, 1, payload)
    assert ledger.to_resend(1) == []
    echo = ledger.snapshot()
    ledger.sent("$JS.ACK.d", 1)
    ledger.confirmed(echo, 1, 1)
    assert ledger.snapshot() == {"$JS.ACK.d": (1, b"")}


# -- the native asyncio adapter ---------------------------------------------------------


def test_async_close_hands_back_at_once_flushes_acks_and_then_refuses_everything(
        nats_url: str, topic: str) -> None:
    """AsyncNatsJetStreamBroker: what close() found unsettled is NAKed (back to the
    group at once, ack_wait being far longer than the test), the acks sent just before
    are confirmed, and every operation afterwards raises BrokerClosed."""
    from msgpatterns.aio import AsyncNatsJetStreamBroker

    async def run() -> tuple[list[Message], list[bytes]]:
        broker = AsyncNatsJetStreamBroker(nats_url, visibility_timeout=300)
        await broker.publish_many(topic, [f"{i}".encode() for i in range(20)])
        got: list[Message] = []
        while len(got) < 20:
            got += await broker.fetch(topic, "g", max_messages=20, timeout=1)
        for message in got[:15]:
            await broker.ack(message)
        await broker.close()  # right after the acks; five never settled
        for call in (lambda: broker.publish(topic, b"x"),
                     lambda: broker.fetch(topic, "g"),
                     lambda: broker.ack(got[15]),
                     lambda: broker.nack(got[15], 1.0),
                     lambda: broker.subscribe(topic, "g")):
            with pytest.raises(BrokerClosed):
                await call()
        await broker.close()  # idempotent
        async with AsyncNatsJetStreamBroker(nats_url, visibility_timeout=300) as again:
            back: list[Message] = []
            for _ in range(50):
                back += await again.fetch(topic, "g", max_messages=20, timeout=0.2)
                if len(back) >= 5:
                    break
            for message in back:
                await again.ack(message)
        return got, [m.raw_body for m in back]

    got, back = asyncio.run(run())
    assert sorted(back) == sorted(m.raw_body for m in got[15:])
    assert consumer_state(nats_url, topic, "g") == (0, 0)


def test_async_unreachable_server_fails_fast_with_a_typed_error() -> None:
    require_library("nats", "AsyncNatsJetStreamBroker")
    from msgpatterns.aio import AsyncNatsJetStreamBroker

    async def run() -> None:
        broker = AsyncNatsJetStreamBroker("nats://127.0.0.1:1", connect_timeout=1.0)
        try:
            with pytest.raises(BrokerUnavailable, match=r"127\.0\.0\.1:1"):
                await broker.connect()
        finally:
            await broker.close()

    asyncio.run(run())


@pytest.mark.parametrize("bad", ["orders.*", "has space", "orders.__dlq"])
def test_async_topics_that_are_not_plain_subjects_are_refused(nats_url: str,
                                                              bad: str) -> None:
    from msgpatterns.aio import AsyncNatsJetStreamBroker

    async def run() -> None:
        async with AsyncNatsJetStreamBroker(nats_url) as broker:
            with pytest.raises(ConfigurationError):
                await broker.publish(bad, b"x")

    asyncio.run(run())


def test_async_dead_letter_admin_lists_and_replays_what_the_async_adapter_buried(
        nats_url: str, topic: str) -> None:
    from msgpatterns.aio import AsyncDeadLetters, AsyncNatsJetStreamBroker
    from msgpatterns.deadletter import DeadLetter

    async def run() -> None:
        async with AsyncNatsJetStreamBroker(nats_url) as broker:
            await broker.publish(topic, b"poison", key="p1")
            [message] = await broker.fetch(topic, "g", max_messages=1, timeout=5)
            record = DeadLetter.from_error(message, ValueError("no"), now=broker.now(),
                                           reason="rejected", group="g")
            await broker.dead_letter(message, record)
            async with AsyncDeadLetters(broker.dead_letter_admin()) as admin:
                [listed] = await admin.list_dead_letters(topic, "g")
                assert listed.message.key == "p1" and listed.reason == "rejected"
                assert await admin.replay_dead_letters(topic, "g") == 1
            [replayed] = await broker.fetch(topic, "g", max_messages=1, timeout=5)
            assert (replayed.key, replayed.attempt) == ("p1", 1)
            await broker.ack(replayed)

    asyncio.run(run())


def test_a_fetch_never_hands_out_more_than_asked_and_keeps_the_rest_for_the_next() -> None:
    """nats-py's pull ``fetch(n)`` hands over every late answer its subscription holds,
    which can be more than ``n`` (AsyncConsumer's max_in_flight was exceeded by it): the
    session hands out ``n``, keeps the rest for the next fetch and hands them back on
    close. Both adapters run this session; no server needed."""
    require_library("nats", "AsyncNatsJetStreamBroker")
    from msgpatterns.brokers.nats._session import JetStreamSession

    class Main:
        def __init__(self) -> None:
            self.calls: list[int] = []

        async def fetch(self, batch: int, timeout: float) -> list[str]:
            self.calls.append(batch)
            return [f"late-{i}" for i in range(5)] if len(self.calls) == 1 else []

    class Session(JetStreamSession):
        def __init__(self) -> None:
            self._closed = False
            self._start_session()

        async def _probe(self, probe: Any, limit: int) -> list[Any]:
            return []

        async def _message(self, msg: Any, topic: str, group: str) -> Message | None:
            return Message(msg.encode(), id=msg)

    async def run() -> tuple[list[list[str | None]], list[int], list[Any]]:
        session = Session()
        main = Main()
        session._subs[("t", "g")] = (SimpleNamespace(sub=None), main)
        rounds = [[m.id for m in await session._fetch(["t"], "g", 3, 0.01)]
                  for _ in range(3)]
        return rounds, main.calls, session._buffered()

    rounds, calls, left = asyncio.run(run())
    assert rounds == [["late-0", "late-1", "late-2"], ["late-3", "late-4"], []]
    assert calls == [3, 1, 3]  # the second fetch asked only for what was still wanted
    assert left == []  # nothing left to hand back on close
