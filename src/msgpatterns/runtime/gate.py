"""The ordered key gate: one message per key at a time, in delivery order.

Used by both drivers (:class:`~msgpatterns.Consumer` and
:class:`~msgpatterns.aio.AsyncConsumer`) in ordered mode. It knows nothing about
threads or tasks: it answers "may this message run now?" and "who runs next?".
"""

from __future__ import annotations

import threading
from collections import deque

from msgpatterns.message import Message

__all__ = ["KeyGate", "ordering_key"]


def ordering_key(message: Message) -> str:
    """The ordering key: ``message.key``, else the message id; messages with neither
    share one key (they keep their relative order)."""
    if message.key is not None:
        return message.key
    return message.id if message.id is not None else ""


class KeyGate:
    """Ordered mode: one message per key at a time, in delivery order.

    A key is owned by one message from the moment it is admitted until it is finally
    settled (acked, dead-lettered or handed back); its retry copies inherit the
    ownership. Messages of an owned key wait in that key's backlog, in order.
    Safe from any thread.
    """

    key = staticmethod(ordering_key)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, Message] = {}
        self._backlog: dict[str, deque[Message]] = {}
        self.parked = 0  # messages waiting in backlogs

    def admit(self, message: Message) -> bool:
        """True if ``message`` may run now; otherwise it joins its key's backlog."""
        key = ordering_key(message)
        with self._lock:
            owner = self._owner.get(key)
            if owner is None:
                self._owner[key] = message
                return True
            if owner is message:
                return True
            self._backlog.setdefault(key, deque()).append(message)
            self.parked += 1
            return False

    def transfer(self, old: Message, new: Message) -> None:
        """A retry copy takes over its key from the delivery it replaces."""
        key = ordering_key(old)
        with self._lock:
            if self._owner.get(key) is old:
                self._owner[key] = new

    def release(self, message: Message) -> Message | None:
        """``message`` is finally settled: the next message of its key, now admitted."""
        key = ordering_key(message)
        with self._lock:
            if self._owner.get(key) is not message:
                return None
            backlog = self._backlog.get(key)
            if not backlog:
                del self._owner[key]
                return None
            following = backlog.popleft()
            self.parked -= 1
            if not backlog:
                del self._backlog[key]
            self._owner[key] = following
            return following
