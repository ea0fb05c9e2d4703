"""Assertions about what a broker and a handler did, with messages that say what went wrong."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Iterable

from msgpatterns.brokers.memory.broker import InMemoryBroker
from msgpatterns.deadletter import DeadLetter

__all__ = ["EffectLog", "assert_all_acked", "assert_dead_lettered", "assert_no_dead_letters"]


def assert_all_acked(broker: InMemoryBroker, *, allow_dead: bool = False) -> None:
    """Every published message was acked, none is pending, none is dead (unless
    ``allow_dead``: then a dead letter counts as settled), and no delivery was acked
    twice."""
    settled = {m.id for m in broker.acked}
    if allow_dead:
        settled |= {d.id for d in broker.dead_letters}
    missing = [m for m in broker.published if m.id not in settled]
    problems = []
    if missing:
        problems.append(f"{len(missing)} message(s) never acked, e.g. {missing[:3]}")
    if broker.pending:
        problems.append(f"{broker.pending} message(s) still pending")
    if broker.dead_letters and not allow_dead:
        problems.append(
            f"{len(broker.dead_letters)} dead letter(s): "
            + "; ".join(f"{d.id}: {d.reason}" for d in broker.dead_letters[:3])
        )
    if broker.stats.double_acks:
        problems.append(f"{broker.stats.double_acks} delivery(ies) acked twice")
    if problems:
        raise AssertionError("not every message acked exactly once: " + "; ".join(problems))


def assert_no_dead_letters(broker: InMemoryBroker) -> None:
    """No message went to the dead-letter store."""
    dead = broker.dead_letters
    if dead:
        raise AssertionError(
            f"{len(dead)} dead letter(s): " + "; ".join(f"{d.id}: {d.reason}" for d in dead[:5])
        )


def assert_dead_lettered(
    broker: InMemoryBroker, count: int | None = None, *, reason: str | None = None
) -> list[DeadLetter]:
    """There are dead letters (exactly ``count`` if given), each reason containing
    ``reason`` if given; returns them."""
    dead = broker.dead_letters
    if count is not None and len(dead) != count:
        raise AssertionError(f"expected {count} dead letter(s), found {len(dead)}: {dead}")
    if count is None and not dead:
        raise AssertionError("expected dead letters, found none")
    if reason is not None:
        wrong = [d for d in dead if reason not in d.reason]
        if wrong:
            reasons = [d.reason for d in wrong]
            raise AssertionError(f"dead letter reasons lack {reason!r}: {reasons}")
    return dead


class EffectLog:
    """Records side effects by key from any thread and checks each happened once.

    Use it as the "business write" of a handler under test::

        effects = EffectLog()
        def handle(message):
            effects.record(message.key)
        ...
        effects.assert_exactly_once(expected_keys)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[Hashable] = Counter()
        self.order: list[Hashable] = []

    def record(self, key: Hashable) -> None:
        with self._lock:
            self._counts[key] += 1
            self.order.append(key)

    def count(self, key: Hashable) -> int:
        with self._lock:
            return self._counts[key]

    def __len__(self) -> int:
        return len(self.order)

    def assert_exactly_once(self, expected: Iterable[Hashable]) -> None:
        """Every expected key applied exactly once, and nothing else applied."""
        wanted = set(expected)
        with self._lock:
            counts = dict(self._counts)
        twice = {k: n for k, n in counts.items() if n > 1}
        missing = wanted - counts.keys()
        extra = counts.keys() - wanted
        problems = []
        if twice:
            problems.append(f"applied more than once: {dict(list(twice.items())[:5])}")
        if missing:
            problems.append(f"never applied: {sorted(map(str, missing))[:5]}")
        if extra:
            problems.append(f"unexpected: {sorted(map(str, extra))[:5]}")
        if problems:
            raise AssertionError("effects not exactly once: " + "; ".join(problems))
