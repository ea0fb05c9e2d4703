"""BrokerAdapter: the plumbing every sync broker adapter shares.

The parts of the :class:`~msgpatterns.brokers.base.Broker` protocol that do not depend
on the broker live here once: the ``publish`` signature (an adapter writes only
``_publish`` with the body already bytes), ``now()`` (the wall clock), the
closed-state check, the context-manager protocol, topic-list normalisation, and the
dead-letter admin (``dead_letter_admin()`` plus the ``list_dead_letters`` /
``replay_dead_letters`` / ``purge_dead_letters`` shortcuts that delegate to it).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.errors import BrokerClosed, ConfigurationError

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.base import DeadLetterAdmin

__all__ = ["BrokerAdapter", "topic_list"]


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


class BrokerAdapter(ABC):
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

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` was called."""

    def _check_open(self) -> None:
        """Raise :class:`~msgpatterns.errors.BrokerClosed` at once after :meth:`close`."""
        if self.closed:
            raise BrokerClosed(f"{self!r} is closed")

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
