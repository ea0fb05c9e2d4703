"""TopicFeed: the consumer side of an :class:`~msgpatterns.ordering.OrderedTopic`.

A TopicFeed is a :class:`~msgpatterns.brokers.Broker` a :class:`~msgpatterns.Consumer`
fetches from. Behind it, one consumer process:

* is a member of its group (a heartbeat in the route store) and leases physical
  partitions, at most one owner per partition, up to its fair share
  (``ceil(partitions to consume / live members)``); a dead member's leases expire
  after ``lease_ttl`` and its partitions are taken over;
* hands back a partition above its fair share (a member joined) at a settled point:
  it stops fetching from it, waits until everything fetched from it is settled for
  good, hands back what the broker read ahead of it (Redis), then releases the lease -
  so a new member gets its share under a backlog too, and starts where this one
  stopped;
* takes over a partition whose lease ran out (its owner died or stalled) only
  ``takeover_delay`` seconds later (by default the broker's ``visibility_timeout``):
  by then the broker redelivers what the dead owner had fetched and not settled, and
  brokers hand such redeliveries out before later messages (Redis Streams claims
  stale deliveries first, RabbitMQ requeues at the head, Kafka re-reads from the
  committed offset, :class:`InMemoryBroker` puts timed-out deliveries back at the
  head), so a key's unsettled message is handled before its later ones;
* consumes a partition opened by a route change only after every partition that
  change closed has been recorded (by whichever member consumed it), so each key's
  messages in an old partition are handled before any of its messages in a new one;
* holds back a command message: when every message fetched from its partition has
  been settled for good (acked or dead-lettered: a retried message comes back and
  is waited for) and the topic's ``fence`` has passed since it was appended, it
  records the command, acks it and hands the partition back.

Retries keep order: the :class:`~msgpatterns.Consumer` (``ordered=True``) keeps a
message that waits for a retry in the process, holding back the later messages of its
key and of no other key. When it is dead-lettered, ``on_dead_letter`` decides:
``"continue"`` (the default) lets the key's next message run; ``"stop"`` dead-letters
every later message of that key this member fetches from that partition too (reason
:class:`~msgpatterns.ordering.errors.KeyStopped`), so no later message of the key is
applied after a gap. The stopped keys live in this member's memory: a takeover or a
route change starts them afresh (replay the dead letters in order to resume a key).

The handler never sees command messages, nor a message without a route version (a
foreign publisher wrote straight into a partition stream or queue): such a message
is dead-lettered with :class:`~msgpatterns.ordering.errors.UnroutedMessage` as the
reason, and the partition goes on. To publish from another language, read the route
(see :class:`~msgpatterns.ordering.RedisRouteStore` and
:class:`~msgpatterns.ordering.SqlRouteStore` for the layout), route the key yourself
and set the ``x-msgpatterns-route-version`` and ``x-msgpatterns-logic-partition``
headers. Route changes are followed one version at a
time because each partition's successors wait for it, whatever the version history.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import ConfigurationError
from msgpatterns.headers import WireBounds
from msgpatterns.message import Message
from msgpatterns.ordering.routes import Route, closed_by, predecessors

if TYPE_CHECKING:
    from msgpatterns.ordering.topic import OrderedTopic

__all__ = ["FeedStats", "TopicFeed"]

log = logging.getLogger(__name__)


class FeedStats:
    """Counters of one TopicFeed."""

    __slots__ = ("commands_recorded", "late", "leases_lost", "leases_taken")

    def __init__(self) -> None:
        self.commands_recorded = 0
        self.leases_taken = 0
        self.leases_lost = 0
        #: messages fetched from a partition after its command was recorded
        self.late = 0


class _Held:
    """What this feed tracks of one leased partition."""

    __slots__ = ("command", "command_at", "command_message", "draining", "outstanding",
                 "readable_at", "recorded_at", "retrying")

    def __init__(self, readable_at: float = float("-inf")) -> None:
        self.readable_at = readable_at  # a takeover waits for the dead owner's redeliveries
        self.outstanding: dict[str, int] = {}  # message id -> fetched, not settled
        self.retrying: set[str] = set()  # nacked: they come back to this partition
        self.command: int | None = None  # the version of the command message reached
        self.command_at = 0.0
        self.command_message: Message | None = None
        self.recorded_at: float | None = None
        self.draining = False  # above the fair share: no more fetches, then handed back

    def busy(self) -> bool:
        """Messages fetched from the partition and not settled for good."""
        return bool(self.outstanding or self.retrying)


class TopicFeed:
    """A Broker over the physical partitions of an ordered topic this process leases."""

    def __init__(self, topic: OrderedTopic, group: str, *, owner: str | None = None,
                 lease_ttl: float = 10.0, refresh: float = 0.5,
                 takeover_delay: float | None = None,
                 on_dead_letter: str = "continue") -> None:
        if on_dead_letter not in ("continue", "stop"):
            raise ConfigurationError(
                f'on_dead_letter must be "continue" or "stop", got {on_dead_letter!r}')
        self.on_dead_letter = on_dead_letter
        self._stopped: set[tuple[int, str]] = set()  # (physical, key) after a dead letter
        if lease_ttl <= 0 or refresh <= 0 or refresh >= lease_ttl:
            raise ConfigurationError("need 0 < refresh < lease_ttl")
        if takeover_delay is None:
            takeover_delay = float(getattr(topic.broker, "visibility_timeout", 0.0) or 0.0)
        if takeover_delay < 0:
            raise ConfigurationError("takeover_delay must be >= 0")
        self.takeover_delay = takeover_delay
        self.topic = topic
        self.group = group
        self.owner = owner or uuid.uuid4().hex
        self.lease_ttl = lease_ttl
        self.refresh = refresh
        self.stats = FeedStats()
        self._inner = topic.broker
        self._store = topic.store
        self._lock = threading.RLock()
        self._held: dict[int, _Held] = {}
        self._history: list[Route] = []
        self._recorded: frozenset[tuple[int, int]] = frozenset()
        self._refreshed_at = float("-inf")
        #: Seconds between route reads: ``refresh``, or a tenth of it while a route
        #: change waits for a recording (see :meth:`rebalance`).
        self._interval = refresh
        self._closed = False
        self._wake = threading.Event()

    # -- the route state ------------------------------------------------------------

    def _now(self) -> float:
        return time.time()

    def _maybe_refresh(self) -> None:
        if time.monotonic() - self._refreshed_at >= self._interval:
            self.rebalance()

    def rebalance(self) -> None:
        """Read the routes, renew and balance this member's leases (the feed does this
        every ``refresh`` seconds on its own)."""
        with self._lock:
            now = self._now()
            name, group = self.topic.name, self.group
            self._store.heartbeat(name, group, self.owner, now, self.lease_ttl)
            state = self.topic.state()
            self._history = self._store.history(name)
            if state.pending is not None:
                self._history.append(state.pending)
            self._recorded = self._store.commands(name, group)
            wanted = self._to_consume()
            members = max(1, len(self._store.members(name, group, now)))
            share = math.ceil(len(wanted) / members) if wanted else 0
            for physical in list(self._held):
                if not self._store.lease(name, group, physical, self.owner, now,
                                         self.lease_ttl):
                    self.stats.leases_lost += 1
                    log.warning("lease of %s partition %d lost", name, physical)
                    self._hand_back_unfetched([physical])
                    del self._held[physical]
            self._release_done()
            leases = self._store.leases(name, group, now)
            dead = self._store.expired_leases(name, group, now) if wanted else {}
            for physical in sorted(wanted):
                if len(self._held) >= share:
                    break
                if physical in self._held or physical in leases:
                    continue
                if self._store.lease(name, group, physical, self.owner, now, self.lease_ttl):
                    taken_over = dead.get(physical, self.owner) != self.owner
                    if taken_over:
                        log.warning("%s partition %d: lease of %s ran out; taking over in "
                                    "%.3gs", name, physical, dead[physical],
                                    self.takeover_delay)
                    self._held[physical] = _Held(
                        now + self.takeover_delay if taken_over else float("-inf"))
                    self.stats.leases_taken += 1
            self._hand_back_surplus(share)
            # A partition waits for its predecessors' commands to be recorded (by any
            # member), or this member holds a command to record: look a tenth as long.
            waiting = (len(self._to_consume()) < len(self._unfinished())
                       or any((h.command is not None and h.recorded_at is None)
                              or h.draining for h in self._held.values()))
            self._interval = self.refresh / 10 if waiting else self.refresh
            self._refreshed_at = time.monotonic()

    def _hand_back_surplus(self, share: int) -> None:
        """Lock held: hand back the partitions above this member's fair ``share`` (a
        member joined), idle ones first. A busy one (messages fetched and not settled)
        is *drained*: no more fetches from it, and once everything fetched from it is
        settled for good - a settled point - it is handed back, what the broker read
        ahead of it first. So a new member gets its share under a backlog too, and the
        next owner starts exactly where this one stopped."""
        candidates = sorted((p for p, h in self._held.items() if h.command is None),
                            key=lambda p: (self._held[p].busy(), -p))
        surplus = set(candidates[:max(0, len(self._held) - share)])
        for physical in list(self._held):
            held = self._held[physical]
            held.draining = physical in surplus
            if held.draining and not held.busy():
                self._give_up(physical)

    def _to_consume(self) -> set[int]:
        """The partitions that are not finished and whose predecessors are."""
        done = self._finished()
        out: set[int] = set()
        for physical, (_, closed) in predecessors(self._history).items():
            if physical not in done and all(c in done for c in closed):
                out.add(physical)
        return out

    def _unfinished(self) -> set[int]:
        """Every partition of the history not finished yet (blocked or not)."""
        done = self._finished()
        return {p for p in predecessors(self._history) if p not in done}

    def _finished(self) -> set[int]:
        return {p for p, version in closed_by(self._history).items()
                if (version, p) in self._recorded}

    def _release_done(self) -> None:
        """Hand back partitions whose command is recorded and whose late window passed."""
        now = self._now()
        for physical in list(self._held):
            held = self._held[physical]
            if (held.recorded_at is not None and not held.outstanding and not held.retrying
                    and now - held.recorded_at >= self.topic.fence):
                self._give_up(physical)

    def _give_up(self, physical: int) -> None:
        """Lock held: hand ``physical`` back. What the broker below read ahead of this
        partition (and no fetch took) is handed back first, so the next owner gets
        those messages before the later ones it reads itself."""
        self._hand_back_unfetched([physical])
        self._store.release(self.topic.name, self.group, physical, self.owner)
        del self._held[physical]

    def _hand_back_unfetched(self, partitions: list[int]) -> None:
        hand_back = getattr(self._inner, "hand_back_unfetched", None)
        if hand_back is not None and partitions:
            hand_back([self.topic.partition_topic(p) for p in partitions], self.group)

    # -- Broker protocol ------------------------------------------------------------

    def bound_wire(self, group: str, bounds: WireBounds) -> None:
        """Pass the consumer's header bounds to the broker underneath (it reads the
        deliveries: :class:`~msgpatterns.brokers.base.SupportsWireBounds`)."""
        inner = getattr(self._inner, "bound_wire", None)
        if inner is not None:
            inner(group, bounds)

    def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
              timeout: float = 0.0) -> list[Message]:
        """Messages of the partitions this member may consume now (never a command)."""
        if group != self.group:
            raise ConfigurationError(f"this feed belongs to group {self.group!r}")
        self._maybe_refresh()
        with self._lock:
            self._record_ready()
            now = self._now()
            readable = [self.topic.partition_topic(p) for p, held in sorted(self._held.items())
                        if held.readable_at <= now and not held.draining]
        wait = min(timeout, self._interval, self._until_fence())
        if not readable:
            # a broker whose group needs its members served while they read nothing
            # (Kafka: a member that stops polling holds up the group's rebalances)
            idle = getattr(self._inner, "idle", None)
            if idle is None or not idle(group, wait):
                self._wake.wait(wait)
            return []
        fetched = self._inner.fetch(readable, group, max_messages, wait)
        out: list[Message] = []
        with self._lock:
            for message in fetched:
                physical = self.topic.physical_of_topic(message.topic or "")
                held = self._held.get(physical)
                if held is None:  # lease lost meanwhile: let the broker redeliver it
                    self._inner.nack(message, 0.0)
                    continue
                if _is_command(message):
                    self._reach_command(physical, held, message)
                    continue
                if not _is_routed(message):
                    self._refuse(message)
                    continue
                if (physical, message.key or "") in self._stopped:
                    self._stop_key(message)
                    continue
                if held.recorded_at is not None:
                    self.stats.late += 1
                    log.warning("message %s reached %s partition %d after its command "
                                "was recorded (a publish slower than the fence)",
                                message.id, self.topic.name, physical)
                ident = message.id or ""
                held.retrying.discard(ident)
                held.outstanding[ident] = held.outstanding.get(ident, 0) + 1
                out.append(message)
            self._record_ready()
        return out

    def _until_fence(self) -> float:
        """Seconds until the fence of a command this member holds ends (a fetch waits
        no longer: the command is recorded as soon as its fence ends)."""
        with self._lock:
            now = self._now()
            ends = [h.command_at + self.topic.fence - now for h in self._held.values()
                    if h.command is not None and h.recorded_at is None]
        # A fence that ended already waits for settlements, which record it: no spin.
        ends = [end for end in ends if end > 0]
        return min(ends) if ends else float("inf")

    def _refuse(self, message: Message) -> None:
        from msgpatterns.ordering.errors import UnroutedMessage

        error = UnroutedMessage(
            f"message {message.id} in {message.topic} has no route version: it was not "
            "published with OrderedTopic.publish, so its order cannot be kept")
        log.error("%s", error)
        self._inner.dead_letter(message, DeadLetter.from_error(
            message, error, now=self._inner.now(), reason="unrouted", group=self.group))

    def check_key(self, message: Message) -> None:
        """Raise :class:`~msgpatterns.ordering.errors.KeyStopped` when ``message``'s key
        was stopped by a dead letter (``on_dead_letter="stop"``): the consumer then
        dead-letters it. :meth:`OrderedTopic.consumer` calls it before the handler, for
        the messages fetched before their key stopped."""
        if not self._stopped:
            return
        try:
            physical = self.topic.physical_of_topic(message.topic or "")
        except ConfigurationError:
            return
        with self._lock:
            stopped = (physical, message.key or "") in self._stopped
        if stopped:
            raise _key_stopped(message)

    def _stop_key(self, message: Message) -> None:
        self._inner.dead_letter(message, DeadLetter.from_error(
            message, _key_stopped(message), now=self._inner.now(), reason="key-stopped",
            group=self.group))

    def _reach_command(self, physical: int, held: _Held, message: Message) -> None:
        from msgpatterns.ordering.topic import RouteCommand

        command = RouteCommand.parse(message.body)
        if held.command is not None or (command.version, physical) in self._recorded:
            self._inner.ack(message)  # a duplicate of the command
            return
        held.command = command.version
        held.command_at = command.appended_at
        held.command_message = message

    def _record_ready(self) -> None:
        now = self._now()
        for physical, held in self._held.items():
            if (held.command is None or held.recorded_at is not None or held.outstanding
                    or held.retrying or now < held.command_at + self.topic.fence):
                continue
            self._store.record_command(self.topic.name, self.group, held.command, physical)
            assert held.command_message is not None
            self._inner.ack(held.command_message)
            held.recorded_at = now
            self.stats.commands_recorded += 1
            self._refreshed_at = float("-inf")  # successors may be consumable now

    def _settled(self, message: Message, *, retrying: bool = False) -> None:
        try:
            physical = self.topic.physical_of_topic(message.topic or "")
        except ConfigurationError:
            return
        with self._lock:
            held = self._held.get(physical)
            if held is None:
                return
            ident = message.id or ""
            left = held.outstanding.get(ident, 0) - 1
            if left > 0:
                held.outstanding[ident] = left
            else:
                held.outstanding.pop(ident, None)
            if retrying:
                held.retrying.add(ident)
            elif held.command is not None and not held.outstanding:
                self._record_ready()  # the last one before the command: no fetch waited

    def ack(self, message: Message) -> None:
        self._inner.ack(message)
        self._settled(message)
        self._maybe_refresh()  # a consumer busy with a full window still renews its leases

    def nack(self, message: Message, delay: float = 0.0) -> None:
        # The message comes back from the same partition: until it is fetched again it
        # holds the partition's command like an unsettled one.
        self._inner.nack(message, delay)
        self._settled(message, retrying=True)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        self._inner.dead_letter(message, record)
        if self.on_dead_letter == "stop":
            try:
                physical = self.topic.physical_of_topic(message.topic or "")
            except ConfigurationError:
                pass
            else:
                with self._lock:
                    self._stopped.add((physical, message.key or ""))
        self._settled(message)

    def publish(self, topic: str, body: Any, *, key: str | None = None,
                headers: Any = None) -> str:
        return self._inner.publish(topic, body, key=key, headers=headers)

    def now(self) -> float:
        return self._inner.now()

    def close(self) -> None:
        """Leave the group and hand back every lease (the broker stays open)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._hand_back_unfetched(list(self._held))
            for physical in list(self._held):
                self._store.release(self.topic.name, self.group, physical, self.owner)
            self._held.clear()
            self._store.leave(self.topic.name, self.group, self.owner)
        self._wake.set()

    @property
    def held(self) -> list[int]:
        """The physical partitions this member holds now."""
        with self._lock:
            return sorted(self._held)

    def __repr__(self) -> str:
        return f"TopicFeed({self.topic.name!r}, group={self.group!r}, held={self.held})"


def _key_stopped(message: Message) -> Exception:
    from msgpatterns.ordering.errors import KeyStopped

    return KeyStopped(f"an earlier message of key {message.key!r} in {message.topic} was "
                      "dead-lettered (on_dead_letter='stop')")


def _is_routed(message: Message) -> bool:
    from msgpatterns.ordering.topic import ROUTE_VERSION

    return ROUTE_VERSION in message.headers


def _is_command(message: Message) -> bool:
    from msgpatterns.ordering.topic import ROUTE_COMMAND

    return ROUTE_COMMAND in message.headers
