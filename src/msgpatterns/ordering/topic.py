"""OrderedTopic: per-key order across processes that survives split, merge and move.

A key maps to a fixed logic partition (``crc32(key) % logic_partitions``, the function
:class:`OrderedExecutor` uses); a versioned :class:`Route` in a route store maps
contiguous logic ranges to *physical* partitions, one broker topic each
(``<name>.<physical>``: a Redis stream, a RabbitMQ queue, a Kafka topic, a NATS
subject). Changing the number of physical partitions never moves a key between logic
partitions, only ranges between physical partitions, and it is done so that a key's
messages are consumed in the order they were published:

1. The change is *proposed* in the route store (an optimistic compare-and-set on the
   version: one change at a time, versions contiguous). From then on publishers route
   with the new version, so the closed partitions take no new messages.
2. A **command message** is appended to every closed partition: their last message.
3. The version is committed.

Consumers (:meth:`OrderedTopic.consumer`) lease physical partitions in the route
store, at most one consumer per partition. The consumer of a closed partition reaches
its command message, waits until every message before it (and any late one, see
``fence``) is settled, and records that. A partition a change opened is consumed only
once every partition that change closed has been recorded, so every message of a key
in the old partition is handled before any in the new one.

Publishers cache the route for at most ``route_cache`` seconds. A publish that starts
with a route read before a change was proposed can still land in a closed partition
after its command message; the consumer of that partition keeps reading it for
``fence`` seconds after the command was appended (``route_cache`` plus a grace for a
slow publish) and handles such messages before recording the command. A publish that
takes longer than that grace lands after the partition was handed over: it is still
consumed (never lost) by the partition's last consumer, and counted as ``late``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from msgpatterns.brokers.base import Broker
from msgpatterns.errors import ConfigurationError
from msgpatterns.ordering.errors import RouteConflict, RouteError
from msgpatterns.ordering.partitions import Key, key_bytes, logic_partition
from msgpatterns.ordering.route_store import RouteStore, TopicState
from msgpatterns.ordering.routes import Route, initial_route

if TYPE_CHECKING:
    from msgpatterns.aio.consumer import AsyncConsumer
    from msgpatterns.consumer import Consumer
    from msgpatterns.ordering.topic_feed import TopicFeed

__all__ = [
    "LOGIC_PARTITION",
    "OrderedTopic",
    "ROUTE_COMMAND",
    "ROUTE_VERSION",
    "RouteCommand",
]

#: The route version a message was published with.
ROUTE_VERSION = "x-msgpatterns-route-version"
#: The logic partition of a message's key.
LOGIC_PARTITION = "x-msgpatterns-logic-partition"
#: Present (the change's version) on a command message only.
ROUTE_COMMAND = "x-msgpatterns-route-command"


class RouteCommand:
    """The body of a command message: which change closed the partition, and when."""

    __slots__ = ("appended_at", "closed", "opened", "topic", "version")

    def __init__(self, topic: str, version: int, closed: tuple[int, ...],
                 opened: tuple[int, ...], appended_at: float) -> None:
        self.topic = topic
        self.version = version
        self.closed = closed
        self.opened = opened
        self.appended_at = appended_at

    def to_json(self) -> str:
        return json.dumps({"topic": self.topic, "version": self.version,
                           "closed": list(self.closed), "opened": list(self.opened),
                           "appended_at": self.appended_at}, separators=(",", ":"))

    @classmethod
    def parse(cls, body: Any) -> RouteCommand:
        """Parse a command message's body; RouteError when it is not one."""
        try:
            data = json.loads(body if isinstance(body, str | bytes | bytearray)
                              else json.dumps(body))
            return cls(str(data["topic"]), int(data["version"]),
                       tuple(int(p) for p in data["closed"]),
                       tuple(int(p) for p in data["opened"]), float(data["appended_at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise RouteError(f"not a route command message: {exc}") from exc


class OrderedTopic:
    """A topic whose per-key order survives changing its number of physical partitions.

    Args:
        broker: the broker the physical partitions live on (any :class:`Broker`).
        name: the topic's name; physical partition ``p`` is broker topic ``name.p``.
        routes: the route store (:class:`SqlRouteStore`, :class:`RedisRouteStore`,
            :class:`MemoryRouteStore`), shared by every publisher and consumer.
        logic_partitions: fixed for the topic's life (1024 by default).
        route_cache: publishers use a route read at most this many seconds ago
            (0.05 s: a publisher reads the route store at most 20 times a second).
        fence: how long after a command message its partition's consumer still reads
            it for late publishes before handing over (at least ``route_cache``; the
            default 0.8 s leaves a publish 0.75 s of grace, and the command is
            recorded as soon as the fence ends).
        groups: the consumer groups to create on a partition before anything is
            published to it, on brokers that drop a message no group is subscribed to
            (RabbitMQ: a queue per partition and group). :meth:`consumer` adds its
            group; a process that only changes routes (the CLI) must name them.
    """

    def __init__(self, broker: Broker, name: str, *, routes: RouteStore,
                 logic_partitions: int = 1024, route_cache: float = 0.05,
                 fence: float = 0.8, groups: Iterable[str] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError("an ordered topic needs a non-empty name")
        if not isinstance(broker, Broker):
            raise ConfigurationError(
                f"OrderedTopic needs a Broker, got {type(broker).__name__}")
        if route_cache < 0 or fence < route_cache:
            raise ConfigurationError("route_cache must be >= 0 and fence >= route_cache")
        self.broker = broker
        self.name = name
        self.store = routes
        self.logic_partitions = logic_partitions
        self.route_cache = route_cache
        self.fence = fence
        self.groups: list[str] = list(dict.fromkeys(groups))
        self._lock = threading.Lock()
        self._table: list[int] = []
        self._version = "0"
        self._read_at = float("-inf")

    # -- partitions -----------------------------------------------------------------

    def partition_topic(self, physical: int) -> str:
        """The broker topic of physical partition ``physical``."""
        return f"{self.name}.{physical}"

    def physical_of_topic(self, topic: str) -> int:
        """The physical partition of broker topic ``topic`` (inverse of
        :meth:`partition_topic`)."""
        prefix, _, number = topic.rpartition(".")
        if prefix != self.name or not number.isdigit():
            raise RouteError(f"{topic!r} is not a partition of ordered topic {self.name!r}")
        return int(number)

    def create(self, physical: int) -> Route:
        """Create the topic with ``physical`` partitions; idempotent: an existing topic
        is left as it is and its committed route returned."""
        self._declare(range(physical))
        route = self.store.create(self.name, initial_route(physical, self.logic_partitions))
        if route.logic_partitions != self.logic_partitions:
            raise ConfigurationError(
                f"topic {self.name!r} has {route.logic_partitions} logic partitions, "
                f"not {self.logic_partitions}")
        return route

    def state(self) -> TopicState:
        """The committed route and the change in progress (from the store)."""
        state = self.store.state(self.name)
        if state is None:
            raise ConfigurationError(
                f"ordered topic {self.name!r} does not exist: call create(physical=N)")
        return state

    def routes(self) -> list[Route]:
        """The committed route versions, oldest first."""
        return self.store.history(self.name)

    # -- publishing -----------------------------------------------------------------

    def _route_for(self, key: Key) -> tuple[str, str, str]:
        """(broker topic, route version, logic partition) for ``key``."""
        logic = logic_partition(key, self.logic_partitions)
        if time.monotonic() - self._read_at > self.route_cache:
            self._refresh()
        return self.partition_topic(self._table[logic]), self._version, str(logic)

    def _refresh(self) -> None:
        read_at = time.monotonic()
        route = self.state().publishing
        with self._lock:
            self._table = route.table()
            self._version = str(route.version)
            self._read_at = read_at

    def publish(self, key: Key, body: Any, headers: Mapping[str, str] | None = None) -> str:
        """Publish ``body`` under ``key`` to the partition the latest route gives;
        returns the broker's message id. The message carries its route version."""
        topic, version, logic = self._route_for(key)
        out = dict(headers or {})
        out[ROUTE_VERSION] = version
        out[LOGIC_PARTITION] = logic
        return self.broker.publish(topic, body, key=_key_text(key), headers=out)

    def publish_many(self, items: Iterable[tuple[Key, Any] | tuple[Key, Any, Mapping[str, str]]]
                     ) -> list[str]:
        """Publish ``(key, body)`` or ``(key, body, headers)`` items in order."""
        return [self.publish(*item) for item in items]

    # -- route changes --------------------------------------------------------------

    def split(self, physical: int, at: int | None = None) -> Route:
        """Split ``physical`` at logic partition ``at`` (the middle by default)."""
        return self._change(lambda route: route.split(physical, at))

    def merge(self, a: int, b: int) -> Route:
        """Merge two physical partitions with adjacent logic ranges."""
        return self._change(lambda route: route.merge(a, b))

    def move(self, physical: int) -> Route:
        """Move ``physical``'s range to a new physical partition."""
        return self._change(lambda route: route.move(physical))

    def _change(self, make: Any) -> Route:
        state = self.state()
        if state.pending is not None:  # a changer died half-way: finish its change
            self._append_commands_and_commit(state.pending)
            state = self.state()
        new: Route = make(state.committed)
        self._declare(new.opened)  # before any publisher can route to them
        if not self.store.propose(self.name, new):
            raise RouteConflict(
                f"another change of {self.name!r} won version {new.version}; "
                "read the routes again")
        self._append_commands_and_commit(new)
        self._read_at = float("-inf")
        return new

    def _declare(self, physicals: Iterable[int]) -> None:
        """Create partitions ``physicals`` for every known group on brokers that need
        it (``subscribe``: a RabbitMQ queue, a Redis consumer group)."""
        subscribe = getattr(self.broker, "subscribe", None)
        if subscribe is None:
            return
        for physical in physicals:
            for group in self.groups:
                subscribe(self.partition_topic(physical), group)

    def _append_commands_and_commit(self, route: Route) -> None:
        command = RouteCommand(self.name, route.version, route.closed, route.opened,
                               time.time())
        headers = {ROUTE_COMMAND: str(route.version), ROUTE_VERSION: str(route.version)}
        for closed in route.closed:
            self.broker.publish(self.partition_topic(closed), command.to_json(),
                                headers=headers)
        self.store.commit(self.name, route.version)

    # -- consuming ------------------------------------------------------------------

    def feed(self, group: str, *, owner: str | None = None, lease_ttl: float = 10.0,
             refresh: float = 0.5, takeover_delay: float | None = None,
             on_dead_letter: str = "continue") -> TopicFeed:
        """The :class:`~msgpatterns.ordering.topic_feed.TopicFeed` of one consumer
        process of ``group``: the sync Broker :meth:`consumer` and :meth:`async_consumer`
        fetch through (its leases, route following and settlement bookkeeping are the
        same for both drivers). Adds ``group`` to :attr:`groups`."""
        from msgpatterns.ordering.topic_feed import TopicFeed

        if group not in self.groups:
            self.groups.append(group)
        return TopicFeed(self, group, owner=owner, lease_ttl=lease_ttl, refresh=refresh,
                         takeover_delay=takeover_delay, on_dead_letter=on_dead_letter)

    def consumer(self, handler: Any, *, group: str, owner: str | None = None,
                 lease_ttl: float = 10.0, refresh: float = 0.5,
                 takeover_delay: float | None = None, on_dead_letter: str = "continue",
                 **options: Any) -> Consumer:
        """A :class:`~msgpatterns.Consumer` over the physical partitions this process
        leases, following route versions one at a time (``ordered=True`` by default:
        per-key order inside the process too).

        ``takeover_delay``: seconds a partition whose owner died waits before this
        process reads it (default: the broker's ``visibility_timeout``), so that the
        dead owner's unsettled messages are redelivered before later ones.

        ``on_dead_letter``: after a message of a key is dead-lettered, ``"continue"``
        lets the key's next message run, ``"stop"`` dead-letters the key's later
        messages too (see :mod:`msgpatterns.ordering.topic_feed`).

        The feed (``consumer.broker``) holds the leases: ``consumer.broker.close()``
        hands them back at once (otherwise they run out after ``lease_ttl``)."""
        from msgpatterns.consumer import Consumer

        feed = self.feed(group, owner=owner, lease_ttl=lease_ttl, refresh=refresh,
                         takeover_delay=takeover_delay, on_dead_letter=on_dead_letter)
        options.setdefault("ordered", True)
        if on_dead_letter == "stop":
            handler = _checking_stopped_keys(feed, handler)
        return Consumer(feed, handler, topics=[self.name], group=group, **options)

    def async_consumer(self, handler: Any, *, group: str, owner: str | None = None,
                       lease_ttl: float = 10.0, refresh: float = 0.5,
                       takeover_delay: float | None = None,
                       on_dead_letter: str = "continue", **options: Any) -> AsyncConsumer:
        """:meth:`consumer` for ``async def`` handlers: an
        :class:`~msgpatterns.aio.AsyncConsumer` (``ordered=True`` by default) over the
        same feed - the same leases, route following, command recording and
        ``on_dead_letter`` - whose broker and route-store calls run in worker threads
        (see :mod:`msgpatterns.aio.ordered_topic`). Create it inside the running event
        loop; ``await consumer.broker.close()`` hands the leases back."""
        from msgpatterns.aio.ordered_topic import topic_consumer

        feed = self.feed(group, owner=owner, lease_ttl=lease_ttl, refresh=refresh,
                         takeover_delay=takeover_delay, on_dead_letter=on_dead_letter)
        return topic_consumer(feed, handler, **options)

    def __repr__(self) -> str:
        return f"OrderedTopic({self.name!r}, routes={self.store!r})"


def _checking_stopped_keys(feed: Any, handler: Any) -> Any:
    """``handler``, refusing first a message whose key a dead letter stopped."""
    import functools

    @functools.wraps(handler)
    def checked(message: Any) -> Any:
        feed.check_key(message)
        return handler(message)

    return checked


def _key_text(key: Key) -> str:
    if isinstance(key, str):
        return key
    return key_bytes(key).decode("utf-8", "backslashreplace")
