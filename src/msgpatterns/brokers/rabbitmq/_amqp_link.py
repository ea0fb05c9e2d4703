"""AmqpLink: one AMQP consume channel of
:class:`~msgpatterns.brokers.rabbitmq.aio.AsyncRabbitMQBroker` and the acks and hand-backs
written on it.

Delivery tags, the ack window and the consumers belong to one channel; a channel that
closed (or whose connection died) is never written to again, and the adapter opens a
new link with a fresh window. Guarantees:

* **One flush at a time.** With the ack window on, acks are written by a single task per
  link, in order: acks settled while it writes are taken by the same task on its next
  round. So a single ack of tag ``t`` is never written after a ``multiple=True`` ack
  that covers ``t`` (RabbitMQ would close the channel: ``PRECONDITION_FAILED - unknown
  delivery tag``).
* **An ack covers only settled deliveries of this channel**
  (:class:`~msgpatterns.brokers.rabbitmq._ack_window.AckWindow`): the contiguous settled prefix
  as one ``basic_ack(multiple=True)``, settled tags above an unsettled one singly. A
  hand-back (``basic_nack`` with requeue) counts as settled only once it is written.
* **A lost link writes nothing.** Once the channel is gone its deliveries are back on
  their queue on the server (they are redelivered); their late acks and hand-backs are
  dropped here and reported as ``False``, never sent on another channel.
* ``window=False`` is the plain twin: one ``basic_ack`` per delivery, written at once.
* In both, a delivery is acked or handed back once: a second settlement of a tag (or
  one of a tag this channel never delivered) writes nothing.

Deliveries must be reported with :meth:`AmqpLink.delivered` in the order the server
sent them: aiormq starts one task per delivery in frame order and asyncio runs new
tasks first-in first-out, so a consume callback that reports before its first
``await`` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from msgpatterns.brokers.rabbitmq._ack_window import AckWindow

__all__ = ["AmqpLink"]

log = logging.getLogger("msgpatterns.aio.rabbitmq")


class AmqpLink:
    """One consume channel (``channel``: aio-pika's; ``raw``: its aiormq channel, which
    writes the acks), numbered ``generation`` by the adapter."""

    __slots__ = ("_flusher", "_on_lost", "_unsettled", "_waiters", "_window", "channel",
                 "consumers", "generation", "lost", "raw", "window")

    def __init__(self, generation: int, channel: Any, raw: Any, *, window: bool = True,
                 on_lost: Callable[[AmqpLink, BaseException | None], None] | None = None
                 ) -> None:
        self._on_lost = on_lost
        self.generation = generation
        self.channel = channel
        self.raw = raw
        self.window = window
        #: queue name -> (aio-pika queue, consumer tag) consuming on this channel.
        self.consumers: dict[str, tuple[Any, str]] = {}
        #: True once the channel is gone: nothing more is written on it.
        self.lost = False
        self._window = AckWindow()
        self._unsettled: set[int] = set()  # delivered here, neither acked nor handed back
        self._waiters: list[asyncio.Future[bool]] = []  # acks awaiting the next round
        self._flusher: asyncio.Task[None] | None = None

    def delivered(self, tag: int) -> None:
        """The server delivered ``tag`` on this channel (in the server's order)."""
        self._unsettled.add(tag)
        self._window.delivered(tag)

    async def ack(self, tag: int) -> bool:
        """Ack delivery ``tag``; returns once the ack was written (True), or False when
        the link is lost (the delivery is redelivered by the server). An ack of a tag
        that is not an unsettled delivery of this channel writes nothing (True)."""
        if self.lost:
            return False
        if tag not in self._unsettled:
            return True  # settled already, or not delivered here: nothing to send
        self._unsettled.discard(tag)
        if not self.window:
            return await self._write(self.raw.basic_ack, tag)
        self._window.ack(tag)
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await asyncio.shield(done)

    async def nack(self, tag: int) -> bool:
        """Hand delivery ``tag`` back to its queue (``basic_nack``, requeue); False when
        the link is lost (the server has it back already)."""
        if self.lost:
            return False
        if tag not in self._unsettled:
            return True  # settled already, or not delivered here: nothing to send
        self._unsettled.discard(tag)
        if not await self._write(self.raw.basic_nack, tag, requeue=True):
            return False
        self._window.gone(tag)  # written: a later multiple ack may pass it
        return True

    async def flushed(self) -> None:
        """Wait until the acks settled so far are written (or the link is lost)."""
        while self._flusher is not None:
            await asyncio.shield(self._flusher)

    def lose(self, reason: BaseException | None = None) -> None:
        """The channel is gone: write nothing more; pending acks report False; then
        ``on_lost(link, reason)`` (once)."""
        if self.lost:
            return
        self.lost = True
        log.debug("AMQP link %d lost (%r)", self.generation, reason)
        self._wake(False)
        if self._on_lost is not None:
            self._on_lost(self, reason)

    def _wake(self, ok: bool) -> None:
        waiters, self._waiters = self._waiters, []
        for done in waiters:
            if not done.done():
                done.set_result(ok)

    async def _write(self, send: Any, tag: int, **kwargs: Any) -> bool:
        try:
            await send(tag, **kwargs)
        except Exception as exc:  # the channel or its connection is gone
            self.lose(exc)
            return False
        return True

    async def _flush(self) -> None:
        """The link's only ack writer: rounds of (take the window, write it, wake its
        acks) until no ack waits."""
        try:
            await asyncio.sleep(0)  # the acks of the same loop turn join the first round
            while self._waiters and not self.lost:
                waiters, self._waiters = self._waiters, []
                upto, singles = self._window.take()
                ok = True
                try:
                    if upto is not None:
                        await self.raw.basic_ack(upto, multiple=True)
                    for tag in singles:
                        await self.raw.basic_ack(tag)
                except Exception as exc:
                    self.lose(exc)
                    ok = False
                for done in waiters:
                    if not done.done():
                        done.set_result(ok)
        finally:
            self._flusher = None
            if self.lost:
                self._wake(False)  # an ack that joined while the last round failed
