"""AckWindow: which delivery tags of one AMQP channel may be acked with one
``basic_ack(tag, multiple=True)``.

``multiple=True`` acks *every* outstanding delivery up to ``tag`` on the channel, so it
may only cover the contiguous prefix of deliveries that are all settled: acked by the
handler, or already settled some other way (handed back with ``basic_nack``, which
takes them off the channel's outstanding set). A settled delivery above an unsettled
one is acked on its own (holding it would pin the prefetch window behind a slow
handler). Tags are per channel and increase; a new channel needs a new window.

Pure bookkeeping, no client: used by the adapter's I/O thread (one thread, no lock).
"""

from __future__ import annotations

from collections import deque

__all__ = ["AckWindow"]


class AckWindow:
    """Delivered tags of one channel, in order, and which are settled."""

    __slots__ = ("_delivered", "_done", "_open", "_to_ack")

    def __init__(self) -> None:
        self._delivered: deque[int] = deque()  # outstanding or settled, in tag order
        self._open: set[int] = set()  # the same tags, for lookups
        self._done: set[int] = set()  # settled (acked below, or taken off otherwise)
        self._to_ack: set[int] = set()  # settled by the handler, ack not sent yet

    def delivered(self, tag: int) -> None:
        """The server delivered ``tag`` (tags arrive in increasing order)."""
        self._delivered.append(tag)
        self._open.add(tag)

    def ack(self, tag: int) -> bool:
        """``tag`` is settled and wants an ack (sent by the next :meth:`take`); False
        (nothing to send) when it is not an unsettled delivery of this window."""
        if tag not in self._open or tag in self._done:
            return False
        self._done.add(tag)
        self._to_ack.add(tag)
        return True

    def gone(self, tag: int) -> None:
        """``tag`` was settled without an ack (``basic_nack`` sent): it is off the
        channel and never acked, but no longer holds the prefix back."""
        if tag in self._open and tag not in self._to_ack:
            self._done.add(tag)

    def take(self) -> tuple[int | None, list[int]]:
        """The acks to send now: ``(upto, singles)``. ``upto`` (or None) is the
        highest tag to ack with ``multiple=True`` - every delivered tag up to it is
        settled; ``singles`` are settled tags above an unsettled one, to ack one by
        one. Both are forgotten here: the caller sends them."""
        upto: int | None = None
        delivered, done, to_ack = self._delivered, self._done, self._to_ack
        while delivered and delivered[0] in done:
            tag = delivered.popleft()
            done.discard(tag)
            self._open.discard(tag)
            if tag in to_ack:
                to_ack.discard(tag)
                upto = tag
        singles = sorted(to_ack)
        to_ack.clear()  # still in done: the prefix passes them later
        return upto, singles

    @property
    def pending(self) -> int:
        """Settled tags whose ack is not sent yet."""
        return len(self._to_ack)

    @property
    def outstanding(self) -> int:
        """Delivered tags not yet settled."""
        return len(self._delivered) - len(self._done)
