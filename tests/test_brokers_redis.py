"""RedisStreamsBroker specifics: retries per group, stale settlements after a claim,
entries from foreign producers, unused reads handed back on close (fakeredis), and
consumer processes SIGKILLed in the middle of acks, retries and dead letters (real
Redis): nothing is lost and nothing is both acked and retried."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from broker_harness import drain, eventually, require_library, sigkill_while_holding
from msgpatterns import Backoff, Consumer, Message, RetryPolicy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake() -> Iterator[Any]:
    require_library("fakeredis", "fakeredis")
    require_library("lupa", "Lua scripts in fakeredis")
    import fakeredis

    client = fakeredis.FakeRedis()
    yield client
    client.close()


def broker_on(client: Any, **kwargs: Any) -> Any:
    from msgpatterns.brokers import RedisStreamsBroker

    return RedisStreamsBroker(client, **kwargs)


def test_a_retry_reaches_only_the_group_that_nacked_it(fake: Any) -> None:
    broker = broker_on(fake)
    broker.publish("s", b"x")
    [mine] = drain(broker, "s", "g1", count=1)
    [theirs] = drain(broker, "s", "g2", count=1)
    broker.ack(theirs)
    broker.nack(mine, 0.0)
    [retry] = drain(broker, "s", "g1", count=1)
    assert (retry.raw_body, retry.attempt, retry.id) == (b"x", 2, mine.id)
    assert drain(broker, "s", "g2", within=0.2) == []
    broker.ack(retry)
    broker.flush()
    assert fake.xlen("s:retry:g1") == 0  # settled retry entries are deleted


def test_a_nack_after_another_consumer_claimed_the_delivery_does_nothing(fake: Any) -> None:
    slow = broker_on(fake, visibility_timeout=0.05, claim_interval=0.01)
    rescuer = broker_on(fake, visibility_timeout=0.05, claim_interval=0.01)
    slow.publish("s", b"x")
    [held] = drain(slow, "s", "g", count=1)
    [claimed] = drain(rescuer, "s", "g", count=1, within=5)
    assert claimed.attempt == 2  # the delivery count
    slow.nack(held, 0.0)  # too late: the delivery is the rescuer's now
    slow.dead_letter(held, _record(held))
    assert fake.xlen("s:retry:g") == 0 and fake.zcard("s:delayed:g") == 0
    assert not fake.exists("s:dlq")
    rescuer.ack(claimed)
    rescuer.flush()
    assert fake.xpending("s", "g")["pending"] == 0


def test_acks_are_batched_and_reach_redis_within_the_flush_interval(fake: Any) -> None:
    batched = broker_on(fake, ack_flush_interval=0.05)
    for i in range(3):
        batched.publish("s", str(i).encode())
    got = drain(batched, "s", "g", count=3)
    for m in got:
        batched.ack(m)
    assert fake.xpending("s", "g")["pending"] == 3  # queued, not sent yet
    eventually(lambda: fake.xpending("s", "g")["pending"] == 0, timeout=5,
               message="the flusher sends the queued acks")

    direct = broker_on(fake, ack_flush_interval=0)
    direct.publish("s", b"3")
    [m] = drain(direct, "s", "g2", count=4)[-1:]
    direct.ack(m)
    assert fake.xpending("s", "g2")["pending"] == 3  # only that one was acked, at once
    batched.close()
    direct.close()


def test_queued_acks_lost_in_a_crash_mean_redelivery_not_loss(fake: Any) -> None:
    dying = broker_on(fake, ack_flush_interval=60, visibility_timeout=0.05,
                      claim_interval=0.01)
    dying.publish("s", b"x")
    [m] = drain(dying, "s", "g", count=1)
    dying.ack(m)  # queued; the process dies before it is sent
    survivor = broker_on(fake, visibility_timeout=0.05, claim_interval=0.01)
    [again] = drain(survivor, "s", "g", count=1, within=5)
    assert again.raw_body == b"x" and again.attempt == 2
    survivor.close()
    dying.close()


def _record(message: Message) -> Any:
    from msgpatterns import DeadLetter

    return DeadLetter.from_error(message, ValueError("x"), now=time.time())


def test_delayed_retry_waits_in_the_sorted_set_then_moves(fake: Any) -> None:
    broker = broker_on(fake)
    broker.publish("s", b"x")
    [m] = drain(broker, "s", "g", count=1)
    broker.nack(m, 30.0)
    # One atomic step: acked in the stream, parked in the delayed set.
    assert fake.xpending("s", "g")["pending"] == 0
    assert fake.zcard("s:delayed:g") == 1
    assert drain(broker, "s", "g", within=0.2) == []
    [(member, due)] = fake.zrange("s:delayed:g", 0, -1, withscores=True)
    fake.zadd("s:delayed:g", {member: due - 30_000})  # make it due now
    [retry] = drain(broker, "s", "g", count=1)
    assert retry.attempt == 2 and fake.zcard("s:delayed:g") == 0


def test_entries_from_other_producers_are_readable(fake: Any) -> None:
    broker = broker_on(fake)
    entry_id = fake.xadd("s", {"order": "42", "state": "paid"}).decode()
    [m] = drain(broker, "s", "g", count=1)
    assert m.id == f"s/{entry_id}"  # entry ids repeat across streams; the name does not
    assert m.raw_body == b'{"order": "42", "state": "paid"}'
    assert m.attempt == 1 and m.headers == {}


def test_reads_never_handed_out_go_back_on_close_without_counting(fake: Any) -> None:
    broker = broker_on(fake)
    broker.publish("a", b"1")
    broker.publish("b", b"2")
    broker.subscribe("a", "g")
    broker.subscribe("b", "g")
    first = broker.fetch(["a", "b"], "g", max_messages=1, timeout=0.1)  # reads one of each
    assert len(first) == 1
    broker.close()
    other = broker_on(fake)
    rest = drain(other, "a", "g", within=0.3) + drain(other, "b", "g", within=0.3)
    # the read-ahead one, and the fetched one close() found still pending: both back
    # at once, neither counted as an attempt
    assert [m.attempt for m in rest] == [1, 1]
    assert {m.raw_body for m in rest} == {b"1", b"2"}


def _pending_ids(client: Any, stream: str, group: str) -> set[str]:
    return {p["message_id"].decode() for p in client.xpending_range(stream, group, "-", "+", 100)}


def test_queued_acks_ride_with_the_next_read_and_only_settled_ones(fake: Any) -> None:
    broker = broker_on(fake, ack_flush_interval=60)  # only a fetch sends the acks
    ids = [broker.publish("s", str(i).encode()).split("/", 1)[1] for i in range(3)]
    got = drain(broker, "s", "g", count=3)
    broker.ack(got[0])  # settled; the other two are still being handled
    assert _pending_ids(fake, "s", "g") == set(ids)  # queued, not sent
    assert broker.fetch("s", "g", max_messages=10, timeout=0) == []
    assert _pending_ids(fake, "s", "g") == set(ids[1:])  # sent with that read, alone
    broker.ack_many(got[1:])
    broker.close()  # flushes the rest
    assert _pending_ids(fake, "s", "g") == set()


def test_a_malformed_entry_mid_batch_is_dead_lettered_the_rest_consumed_once(
        fake: Any) -> None:
    broker = broker_on(fake)
    broker.publish("s", b"first")
    bad = fake.xadd("s", {"body": b"x", "headers": b"not json"}).decode()
    broker.publish("s", b"last")
    got = broker.fetch("s", "g", max_messages=10, timeout=0.1)
    assert [m.raw_body for m in got] == [b"first", b"last"]
    [dead] = broker.list_dead_letters("s")
    assert dead.message.id == f"s/{bad}" and "undecodable" in dead.reason
    broker.ack_many(got)
    broker.flush()
    assert fake.xpending("s", "g")["pending"] == 0
    assert drain(broker, "s", "g", within=0.2) == []  # nothing comes back
    broker.close()


def test_a_read_ahead_is_taken_by_the_next_fetch_or_handed_back_on_close(
        fake: Any) -> None:
    broker = broker_on(fake, read_ahead_hold=60)
    ids = [broker.publish("s", str(i).encode()).split("/", 1)[1] for i in range(7)]
    first = broker.fetch("s", "g", max_messages=2, timeout=0)
    second = broker.fetch("s", "g", max_messages=2, timeout=0)  # full, steady: reads ahead
    assert _pending_ids(fake, "s", "g") == set(ids[:6])  # 4 handed out, 2 read ahead
    third = broker.fetch("s", "g", max_messages=2, timeout=0)  # takes the read-ahead
    assert [m.raw_body for m in first + second + third] == [str(i).encode() for i in range(6)]
    broker.ack_many(first + second + third)
    broker.close()  # the next read-ahead (entry 6) goes back, its attempt unchanged
    assert fake.xpending("s", "g")["pending"] == 0
    other = broker_on(fake)
    [rest] = drain(other, "s", "g", count=1)
    assert (rest.raw_body, rest.attempt, rest.id) == (b"6", 1, f"s/{ids[6]}")
    other.close()


def test_acks_sent_with_a_read_ahead_whose_reply_is_lost_are_sent_again(
        fake: Any) -> None:
    # A kept connection the server already dropped takes a write without complaint
    # and fails only at the read: the acks written with a read-ahead on it never
    # reached Redis, and must go out again.
    import redis

    broker = broker_on(fake, read_ahead_hold=60, ack_flush_interval=60)
    ids = [broker.publish("s", str(i).encode()).split("/", 1)[1] for i in range(8)]
    got = broker.fetch("s", "g", max_messages=2, timeout=0)
    got += broker.fetch("s", "g", max_messages=2, timeout=0)  # reads 2 ahead
    broker.ack_many(got)  # queued: they ride with the next read-ahead
    [first_ahead] = [a for a in broker._aheads.values() if a is not None]
    dead = first_ahead.conn  # kept for the next read-ahead once its reply is read

    def closed_by_server(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("Connection closed by server.")

    def into_a_dead_socket(packed: Any, *args: Any, **kwargs: Any) -> None:
        dead.read_response = closed_by_server  # the write vanished; the read fails

    def disconnect(*args: Any, **kwargs: Any) -> None:  # a new socket works again
        for name in ("send_packed_command", "read_response", "disconnect"):
            vars(dead).pop(name, None)
        dead.disconnect(*args, **kwargs)

    dead.send_packed_command = into_a_dead_socket
    dead.disconnect = disconnect
    third = broker.fetch("s", "g", max_messages=2, timeout=0)  # takes it, reads ahead
    [second_ahead] = [a for a in broker._aheads.values() if a is not None]
    assert second_ahead.conn is dead  # the acks of the first 4 went into it
    broker.ack_many(third)
    broker.close()  # that read-ahead fails: its acks are sent again with the rest
    assert _pending_ids(fake, "s", "g") == set()
    other = broker_on(fake)  # what the lost read-ahead asked for was never delivered
    rest = drain(other, "s", "g", count=2)
    assert [(m.raw_body, m.attempt, m.id) for m in rest] == [
        (str(i).encode(), 1, f"s/{ids[i]}") for i in (6, 7)]
    other.close()


def test_groups_sharing_a_broker_read_ahead_each_and_get_every_entry_once(
        fake: Any) -> None:
    broker = broker_on(fake, read_ahead_hold=60)
    for i in range(9):
        broker.publish("s", str(i).encode())
    got: dict[str, list[bytes]] = {"g1": [], "g2": []}
    for _ in range(6):  # interleaved: each group's read-ahead is its own
        for group in got:
            batch = broker.fetch("s", group, max_messages=2, timeout=0)
            got[group] += [m.raw_body for m in batch]
            broker.ack_many(batch)
    expected = [str(i).encode() for i in range(9)]
    assert got == {"g1": expected, "g2": expected}
    broker.close()
    assert fake.xpending("s", "g1")["pending"] == fake.xpending("s", "g2")["pending"] == 0


def test_a_read_ahead_no_fetch_takes_is_handed_back_after_the_hold(fake: Any) -> None:
    broker = broker_on(fake, read_ahead_hold=0.4)
    for i in range(4):
        broker.publish("s", str(i).encode())
    got = broker.fetch("s", "g", max_messages=2, timeout=0)
    got += broker.fetch("s", "g", max_messages=1, timeout=0)  # reads 1 ahead
    broker.ack_many(got)  # starts the flusher; then this consumer stops fetching
    eventually(lambda: fake.xpending("s", "g")["pending"] == 0, timeout=5,
               message="the flusher hands the unread read-ahead back")
    other = broker_on(fake)
    [rest] = drain(other, "s", "g", count=1)
    assert (rest.raw_body, rest.attempt) == (b"3", 1)
    other.close()
    broker.close()


# -- real crashes on the real server -------------------------------------------------


@pytest.fixture
def real(redis_url: str) -> Iterator[tuple[Any, str]]:
    require_library("redis", "RedisStreamsBroker")
    import redis

    client = redis.Redis.from_url(redis_url)
    stream = f"crash-{uuid.uuid4().hex[:10]}"
    yield client, stream
    keys = list(client.scan_iter(match=f"{stream}*"))
    if keys:
        client.delete(*keys)
    client.close()


CHILD = textwrap.dedent("""
    import os, random, signal, sys, threading
    from msgpatterns import Backoff, Consumer, NeedRetry, Reject, RetryPolicy
    from msgpatterns.brokers import RedisStreamsBroker

    url, stream, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    broker = RedisStreamsBroker(url, visibility_timeout=0.5, claim_interval=0.05)
    calls = 0
    lock = threading.Lock()

    def handler(message):
        global calls
        with lock:
            calls += 1
            if calls == 40:  # die mid-flight, mid-retry, mid-ack on other threads
                os.kill(os.getpid(), signal.SIGKILL)
        n = int(message.raw_body)
        if n % 7 == 0:
            raise Reject("poison")
        if n % 3 == 0 and message.attempt == 1:
            raise NeedRetry(delay=rng.choice([0, 0.05, 0.2]))
        os.write(1, b"ok %d\\n" % n)  # one write: lines from threads never interleave

    Consumer(broker, handler, topics=[stream], group="g", workers=4, poll_timeout=0.05,
             retry=RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.05),
                               local_retries=0)).run()
""")


@pytest.mark.redis
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_sigkilled_consumer_loses_nothing_and_dead_letters_once(
    redis_url: str, real: tuple[Any, str], seed: int
) -> None:
    client, stream = real
    broker = broker_on(client, visibility_timeout=0.5, claim_interval=0.05)
    total = 60
    for i in range(1, total + 1):
        broker.publish(stream, str(i).encode())
    child = subprocess.run([sys.executable, "-c", CHILD, redis_url, stream, str(seed)],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    done_by_child = {int(line.split()[1]) for line in child.stdout.splitlines()}
    done_here: set[int] = set()

    def handler(message: Message) -> None:
        n = int(message.raw_body)
        if n % 7 == 0:
            raise ValueError("poison")
        done_here.add(n)

    def settled() -> bool:
        return bool(client.xpending(stream, "g")["pending"] == 0
                    and client.zcard(f"{stream}:delayed:g") == 0
                    and client.xlen(f"{stream}:retry:g") == 0)

    consumer = Consumer(broker, handler, topics=[stream], group="g", workers=2,
                        poll_timeout=0.05,
                        retry=RetryPolicy(max_attempts=1, backoff=Backoff.fixed(0.05)))
    consumer.start()
    try:
        # What the child left (pending, delayed, in the retry stream) all comes back.
        eventually(lambda: settled() and consumer.in_flight == 0, timeout=30,
                   message="the child's leftovers settled")
    finally:
        consumer.stop(5)
    poison = {n for n in range(1, total + 1) if n % 7 == 0}
    assert done_by_child and done_here  # the crash split the work
    assert done_by_child | done_here == set(range(1, total + 1)) - poison  # none lost
    dead = [int(d.message.raw_body) for d in broker.list_dead_letters(stream, "g")]
    assert sorted(dead) == sorted(poison)  # each dead-lettered exactly once
    assert client.xinfo_groups(stream)[0]["lag"] == 0  # nothing left unread


@pytest.mark.redis
def test_a_killed_consumers_deliveries_are_claimed_with_their_delivery_count(
    redis_url: str, real: tuple[Any, str]
) -> None:
    client, stream = real
    broker = broker_on(client, visibility_timeout=0.5, claim_interval=0.05)
    for i in range(3):
        broker.publish(stream, f"m{i}".encode())
    sigkill_while_holding(f"RedisStreamsBroker({redis_url!r})", stream, "g", 3)
    got = drain(broker, stream, "g", count=3, within=10)
    assert sorted(m.raw_body for m in got) == [b"m0", b"m1", b"m2"]
    assert {m.attempt for m in got} == {2}
    for m in got:
        broker.ack(m)
    broker.flush()
    assert client.xpending(stream, "g")["pending"] == 0
