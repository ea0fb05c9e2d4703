"""Runs an ordered-topic schedule: a publisher, consumers with their own broker
connections and feeds, random splits, merges and moves, consumer crashes and restarts.

Every schedule runs on either driver (``driver="sync"``: :class:`Consumer`;
``"async"``: :class:`AsyncConsumer`, as ``OrderedTopic.async_consumer`` builds it, on an
event loop thread of the run's own) with the same feeds, handler body and assertions.

A crashed consumer behaves like a killed process: from the crash on its handler has no
effect, nothing it settles reaches the broker (its acks are lost), its feed is never
closed (its leases run out) and it never fetches again. A restart is a new consumer
with a new owner id and a new broker connection.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from msgpatterns import Consumer, Message, RetryPolicy, idempotent
from msgpatterns.aio import AsyncConsumer
from msgpatterns.aio.ordered_topic import topic_consumer
from msgpatterns.brokers.base import Broker
from msgpatterns.deadletter import DeadLetter
from msgpatterns.idempotency import MemoryChecker
from msgpatterns.ordering import OrderedTopic, RouteStore
from msgpatterns.ordering.topic_feed import TopicFeed
from msgpatterns.retry import Backoff
from two_drivers import AsyncRunning, Loop, Running, SyncRunning, Until

SEEN_TIMEOUT = 120
#: Seconds an @idempotent claim of a crashed consumer blocks its key.
CLAIM_LEASE = 1.0


class Crashed(Exception):
    """The handler's process is dead."""


@dataclass
class Seen:
    """What the handlers saw, per key, in handling order."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    order: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    effects: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    done: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.done = threading.Condition(self.lock)

    def handled(self) -> int:
        return len(self.effects)


class Mortal:
    """A Broker in front of one consumer's feed that can die (see the module doc)."""

    def __init__(self, feed: TopicFeed) -> None:
        self.feed = feed
        self.dead = threading.Event()

    def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
              timeout: float = 0.0) -> list[Message]:
        if self.dead.is_set():
            self.dead.wait(min(timeout, 0.05))
            return []
        return self.feed.fetch(topics, group, max_messages, timeout)

    def ack(self, message: Message) -> None:
        if not self.dead.is_set():
            self.feed.ack(message)

    def nack(self, message: Message, delay: float = 0.0) -> None:
        if not self.dead.is_set():
            self.feed.nack(message, delay)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        if not self.dead.is_set():
            self.feed.dead_letter(message, record)

    def publish(self, topic: str, body: Any, *, key: str | None = None,
                headers: Any = None) -> str:
        return self.feed.publish(topic, body, key=key, headers=headers)

    def now(self) -> float:
        return self.feed.now()

    def close(self) -> None:
        if not self.dead.is_set():
            self.feed.close()


@dataclass
class Options:
    """How the consumers are configured."""

    lease_ttl: float = 30.0
    refresh: float = 0.02
    takeover_delay: float | None = None
    workers: int = 2
    poll_timeout: float = 0.02
    logic_partitions: int = 64


def run_schedule(make_broker: Callable[[], Broker], store: RouteStore,
                 steps: list[tuple[str, int, int]], *, seed: int, name: str,
                 consumers: int = 3, fail_rate: float = 0.0, slow_rate: float = 0.0,
                 options: Options | None = None,
                 on_crash: Callable[[Broker], None] | None = None,
                 driver: str = "sync") -> dict[str, Any]:
    """Publish per ``steps`` while ``consumers`` consumers consume; return what happened.

    Steps: ``("publish", n, _)`` publishes ``1 + n % 8`` messages over 12 keys;
    ``split``/``merge``/``move`` change the route; ``("crash", i, _)`` kills a live
    consumer and starts a new one in its place (``on_crash`` gets the dead consumer's
    broker connection: a real crash drops it).
    """
    opts = options or Options()
    rng = random.Random(seed)
    publisher = OrderedTopic(make_broker(), name, routes=store,
                             logic_partitions=opts.logic_partitions, route_cache=0.0,
                             fence=0.0, groups=["g"])
    publisher.create(physical=2)
    seen = Seen()
    failed_once: set[tuple[str, int]] = set()
    # A dead consumer's claims hold its keys until their lease runs out (the claim
    # holder could still be running): short here, so a takeover goes on quickly.
    checker = MemoryChecker(lease=CLAIM_LEASE)
    loop = Loop() if driver == "async" else None
    running: list[tuple[Running, Mortal]] = []
    connections: dict[int, Broker] = {}
    brokers: list[Broker] = [publisher.broker]

    def start(index: int) -> None:
        mortal: Mortal | None = None

        def slow() -> bool:
            return bool(slow_rate) and rng.random() < slow_rate

        def effect(message: Message) -> None:
            key, seq = message.key or "", int(message.body)
            if fail_rate and (key, seq) not in failed_once and rng.random() < fail_rate:
                failed_once.add((key, seq))
                raise RuntimeError("transient")
            with seen.lock:
                assert mortal is not None
                if mortal.dead.is_set():  # the crash and the effect are atomic
                    raise Crashed
                if seen.effects[(key, seq)] == 0:
                    seen.order[key].append(seq)
                seen.effects[(key, seq)] += 1
                seen.done.notify_all()

        def sync_effect(message: Message) -> None:
            if slow():
                threading.Event().wait(0.002)
            effect(message)

        async def async_effect(message: Message) -> None:
            if slow():
                await asyncio.sleep(0.002)
            effect(message)

        broker = make_broker()
        brokers.append(broker)
        topic = OrderedTopic(broker, name, routes=store,
                             logic_partitions=opts.logic_partitions, route_cache=0.0,
                             fence=0.0)
        feed = TopicFeed(topic, "g", owner=f"c{index}", lease_ttl=opts.lease_ttl,
                         refresh=opts.refresh, takeover_delay=opts.takeover_delay)
        mortal = Mortal(feed)
        connections[id(mortal)] = broker
        # The ordering key is the business key; each message is its own effect.
        claim = idempotent(checker, key=lambda m: f"{m.key}:{m.body}")
        retry = RetryPolicy(backoff=Backoff.fixed(0.0), local_retries=0)
        consumer: Running
        if loop is None:
            consumer = SyncRunning(Consumer(
                mortal, claim(sync_effect), topics=[name], group="g", ordered=True,
                workers=opts.workers, poll_timeout=opts.poll_timeout, retry=retry))
        else:
            async def make() -> AsyncConsumer:
                return topic_consumer(feed, claim(async_effect), broker=mortal,
                                      max_in_flight=4 * opts.workers,
                                      poll_timeout=opts.poll_timeout, retry=retry)

            consumer = AsyncRunning(loop, loop.call(make()))
        consumer.start()
        running.append((consumer, mortal))

    for i in range(consumers):
        start(i)
    started = consumers
    sequence: dict[str, int] = defaultdict(int)
    published: dict[str, list[int]] = defaultdict(list)
    keys = [f"k{i}" for i in range(12)]
    crashes = 0
    try:
        for kind, a, _b in steps:
            if kind == "publish":
                for _ in range(1 + a % 8):
                    key = rng.choice(keys)
                    sequence[key] += 1
                    publisher.publish(key, str(sequence[key]))
                    published[key].append(sequence[key])
                continue
            if kind == "crash":
                live = [m for _, m in running if not m.dead.is_set()]
                victim = live[a % len(live)]
                with seen.lock:
                    victim.dead.set()
                if on_crash is not None:
                    on_crash(connections[id(victim)])
                crashes += 1
                start(started)
                started += 1
                continue
            route = publisher.state().committed
            segments = route.segments
            if kind == "split":
                seg = segments[a % len(segments)]
                if seg.stop - seg.start >= 2:
                    publisher.split(seg.physical)
            elif kind == "merge" and len(segments) >= 2:
                i = a % (len(segments) - 1)
                publisher.merge(segments[i].physical, segments[i + 1].physical)
            elif kind == "move":
                publisher.move(segments[a % len(segments)].physical)
        total = sum(len(v) for v in published.values())
        with seen.lock:
            finished = seen.done.wait_for(lambda: seen.handled() >= total,
                                          timeout=SEEN_TIMEOUT)
    finally:
        for consumer, _ in running:
            consumer.stop(10)
        for _, mortal in running:
            mortal.close()
        for broker in brokers:
            close = getattr(broker, "close", None)
            if close is not None:
                close()
        if loop is not None:
            loop.close()
    return {"published": published, "seen": seen, "finished": finished,
            "routes": publisher.routes(), "crashes": crashes}


def assert_never_out_of_order_nor_doubled(result: dict[str, Any]) -> None:
    """Safety only: every key's handled sequence is a prefix of its published one, and
    no effect is doubled (whether everything was handled is not checked)."""
    published, seen = result["published"], result["seen"]
    for key, handled in list(seen.order.items()):
        assert handled == published[key][:len(handled)], f"key {key} out of order"
    doubled = {k: n for k, n in seen.effects.items() if n > 1}
    assert not doubled, f"doubled effects: {doubled}"


def assert_ordered_exactly_once(result: dict[str, Any]) -> None:
    """Every key's handled sequence is its published one, and no effect is doubled."""
    published, seen = result["published"], result["seen"]
    assert result["finished"], (
        f"not everything was handled: {seen.handled()} of "
        f"{sum(len(v) for v in published.values())}; routes "
        f"{[r.describe() for r in result['routes']]}")
    for key, sequence in published.items():
        assert seen.order[key] == sequence, f"key {key} out of order"
    doubled = {k: n for k, n in seen.effects.items() if n > 1}
    assert not doubled, f"doubled effects: {doubled}"


class TopicDriver:
    """``OrderedTopic.consumer`` or ``OrderedTopic.async_consumer`` behind one face (the
    async one on an event loop thread of this driver's own), so that a test body runs
    on both. A handler body is a plain function of the message; where it must wait it
    returns a generator of :class:`two_drivers.Until` steps (blocked on by the sync
    driver, awaited by the async one)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = Loop() if name == "async" else None

    def __repr__(self) -> str:
        return self.name

    def consumer(self, topic: OrderedTopic, body: Callable[[Message], Any],
                 **options: Any) -> Running:
        if self.loop is None:
            def handle(message: Message) -> None:
                for step in steps_of(body(message)):
                    _block_until(step)

            return FeedRunning(SyncRunning(topic.consumer(handle, **options)), None)
        options.pop("workers", None)

        async def ahandle(message: Message) -> None:
            for step in steps_of(body(message)):
                give_up = time.monotonic() + step.timeout
                while not step.predicate() and time.monotonic() < give_up:
                    await asyncio.sleep(0.002)

        loop = self.loop

        async def make() -> AsyncConsumer:
            return topic.async_consumer(ahandle, **options)

        return FeedRunning(AsyncRunning(loop, loop.call(make())), loop)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()


class FeedRunning(Running):
    """A running topic consumer; :meth:`stop` also hands its leases back."""

    def __init__(self, inner: SyncRunning | AsyncRunning, loop: Loop | None) -> None:
        self.inner = inner
        self.loop = loop

    def start(self) -> None:
        self.inner.start()

    def stop(self, timeout: float | None = None) -> bool:
        stopped = self.inner.stop(timeout)
        if isinstance(self.inner, SyncRunning):
            self.inner.consumer.broker.close()
        else:
            assert self.loop is not None
            self.loop.call(self.inner.consumer.broker.close())
        return stopped


def steps_of(result: Any) -> Iterator[Until]:
    return result if inspect.isgenerator(result) else iter(())


def _block_until(step: Until) -> None:
    give_up = time.monotonic() + step.timeout
    while not step.predicate() and time.monotonic() < give_up:
        time.sleep(0.002)
