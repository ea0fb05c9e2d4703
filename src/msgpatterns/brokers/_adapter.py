"""BrokerAdapter: the plumbing every sync broker adapter shares.

The parts of the :class:`~msgpatterns.brokers.base.Broker` protocol that do not depend
on the broker live here once: the ``publish`` signature (an adapter writes only
``_publish`` with the body already bytes), ``now()`` (the wall clock), the
closed-state check, the context-manager protocol, topic-list normalisation, and the
dead-letter admin (``dead_letter_admin()`` plus the ``list_dead_letters`` /
``replay_dead_letters`` / ``purge_dead_letters`` shortcuts that delegate to it).
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.errors import BrokerClosed, ConfigurationError
from msgpatterns.headers import WIRE_LIMITS, WireBounds
from msgpatterns.message import Message

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.base import DeadLetterAdmin

__all__ = ["BrokerAdapter", "Closable", "WireTrust", "admin_for", "topic_list"]


def topic_list(topics: str | Sequence[str]) -> list[str]:
    """``topics`` as a list: a single topic name is accepted as well (a bare string is
    never taken for a sequence of one-letter topics)."""
    if isinstance(topics, str):
        return [topics]
    out = list(topics)
    for topic in out:
        if not isinstance(topic, str) or not topic:
            raise ConfigurationError(f"a topic must be a non-empty string, got {topic!r}")
    return out


def admin_for(factory: str, *args: Any, **kwargs: Any) -> DeadLetterAdmin:
    """The dead-letter admin ``factory`` (``"module:name"``: the admin's class, or one
    of its class methods as ``"module:Class.method"``) builds from ``args`` and
    ``kwargs``.

    An adapter names its admin instead of importing it: the admin is a tool built on
    the adapter's wire format (its module may import the adapter's), never a part the
    adapter needs, so nothing circles back at import time and the admin's module loads
    only when an admin is asked for."""
    module, _, name = factory.partition(":")
    build: Any = importlib.import_module(module)
    for part in name.split("."):
        build = getattr(build, part)
    made: DeadLetterAdmin = build(*args, **kwargs)
    return made


class Closable(ABC):
    """The closed-state check shared by the sync and the async adapters."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` was called."""

    def _check_open(self) -> None:
        """Raise :class:`~msgpatterns.errors.BrokerClosed` at once after ``close()``."""
        if self.closed:
            raise BrokerClosed(f"{self!r} is closed")


class WireTrust:
    """How far each consumer group trusts the library's headers on incoming messages
    (:class:`~msgpatterns.headers.WireBounds`), shared by the sync and async adapters.

    A consumer tells its adapter its policy's bounds when it is built
    (:meth:`bound_wire`, the optional
    :class:`~msgpatterns.brokers.base.SupportsWireBounds`); the adapter reads attempt
    counts and due times of that group's deliveries through them
    (:func:`msgpatterns.brokers.codec.attempt_of`,
    :func:`msgpatterns.headers.honoured_due_at`). A group no consumer announced gets
    the library's limits. Two consumers of one group: the looser bound of the two (what
    either writes is trusted). Readers never lock: the table is replaced, never
    changed."""

    _wire_bounds: Mapping[str, WireBounds] = {}

    def bound_wire(self, group: str, bounds: WireBounds) -> None:
        """Trust ``group``'s incoming library headers as far as ``bounds``."""
        table = dict(self._wire_bounds)
        known = table.get(group)
        table[group] = bounds if known is None else known.widest(bounds)
        self._wire_bounds = table

    def wire_bounds(self, group: str) -> WireBounds:
        """The bounds of ``group`` (the library's limits when none was given)."""
        return self._wire_bounds.get(group, WIRE_LIMITS)


class BrokerAdapter(WireTrust, Closable):
    """Base class of the sync adapters (see the module docstring)."""

    def now(self) -> float:
        """The broker's clock: seconds since the epoch."""
        return time.time()

    def publish(self, topic: str, body: Any, *, key: str | None = None,
                headers: Mapping[str, str] | None = None) -> str:
        """Send ``body`` (bytes, or anything :func:`~msgpatterns.deadletter.body_bytes`
        encodes) to ``topic``, confirmed by the broker; returns the message id every
        consumer sees as ``message.id``. Raises
        :class:`~msgpatterns.errors.BrokerClosed` after :meth:`close`."""
        self._check_open()
        return self._publish(topic, body_bytes(body), key, headers or {})

    @abstractmethod
    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        """Send one message (the adapter's wire encoding); its id."""

    def fetch(self, topics: str | Sequence[str], group: str, max_messages: int = 1,
              timeout: float = 0.0) -> list[Message]:
        """Up to ``max_messages`` deliveries of ``topics`` (one topic name is accepted
        too) for ``group``, waiting up to ``timeout`` seconds when none is ready. Each
        has a durable ``attempt`` and a receipt only this adapter reads."""
        return self._fetch_messages(topic_list(topics), group, max_messages, timeout)

    @abstractmethod
    def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                        timeout: float) -> list[Message]:
        """:meth:`fetch` with the topics as a list."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- dead-letter admin ------------------------------------------------------------

    @abstractmethod
    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The :class:`~msgpatterns.brokers.admin.DeadLetterAdmin` of this broker's
        dead letters, on this broker's connection (closing it leaves the broker open)."""

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        """``dead_letter_admin().list_dead_letters(...)``."""
        self._check_open()
        return self.dead_letter_admin().list_dead_letters(topic, group, limit=limit)

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        """``dead_letter_admin().replay_dead_letters(...)``."""
        self._check_open()
        return self.dead_letter_admin().replay_dead_letters(topic, group, ids,
                                                            to_topic=to_topic)

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        """``dead_letter_admin().purge_dead_letters(...)``."""
        self._check_open()
        return self.dead_letter_admin().purge_dead_letters(topic, group, ids)
