"""The asyncio driver's fetching: the fetch loop, a worker's own top-up fetch, and the
jumps of virtual time under ``run_until_idle``.

The asyncio twin of :mod:`.fetcher`. Fetched messages are bound to the settling sink
and admitted to the :class:`~msgpatterns.runtime.async_flow.AsyncFlow` (slots and
ready queue); never more are fetched than ``max_in_flight`` minus the slots held. A
fetch that returns after the stop began is handed back (nothing is lost); a broker
closed under the consumer stops it (``request_stop``); another fetch error is
counted, logged and retried after a pause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from msgpatterns.errors import BrokerClosed
from msgpatterns.message import Message
from msgpatterns.runtime.async_flow import AsyncFlow
from msgpatterns.runtime.async_settling import AsyncSettling
from msgpatterns.runtime.idle import jump_or_none
from msgpatterns.runtime.lifecycle import State
from msgpatterns.runtime.stats import ConsumerStats

__all__ = ["AsyncFetcher"]


class AsyncFetcher:
    """Fetches for one asyncio consumer.

    Args:
        broker: the consumer's :class:`~msgpatterns.aio.base.AsyncBroker`.
        topics, group, max_in_flight, fetch_batch, poll_timeout: the consumer's.
        stats: its counts; ``count``: reports counts to the telemetry listener.
        flow: its slots and ready queue; ``settling``: its settlements (the sink
            bound to every fetched delivery, and the hand-back).
        request_stop: asks the consumer to stop (the broker was closed, or the
            run until idle is over).
        log: the consumer's logger; ``name``: its name.
    """

    def __init__(self, *, broker: Any, topics: list[str], group: str, max_in_flight: int,
                 fetch_batch: int, poll_timeout: float, stats: ConsumerStats,
                 count: Callable[[Mapping[str, int]], None], flow: AsyncFlow,
                 settling: AsyncSettling, request_stop: Callable[[], None],
                 log: logging.Logger, name: str) -> None:
        self.broker = broker
        self.topics = topics
        self.group = group
        self.max_in_flight = max_in_flight
        self.fetch_batch = fetch_batch
        self.poll_timeout = poll_timeout
        self.stats = stats
        self.count = count
        self.flow = flow
        self.settling = settling
        self.request_stop = request_stop
        self.log = log
        self.name = name
        #: Fewest free slots for which a worker fetches itself (see :meth:`top_up`).
        self.top_up_min = max(1, min(fetch_batch, max_in_flight) // 4)
        #: Run until idle: jump virtual time when nothing can run; stop when idle.
        self.until_idle = False
        #: The last fetch: (``time.time()``, succeeded), or None before the first.
        self.last_fetch: tuple[float, bool] | None = None

    async def loop(self) -> None:
        """Fetch while slots are free (the workers take what may run), and (until
        idle) move virtual time when nothing can; exits when the consumer stops."""
        flow = self.flow
        slots = flow.slots
        while flow.state is State.RUNNING:
            free = self.max_in_flight - len(slots)
            if free <= 0:
                # Full: only a settlement, or a held retry coming due, frees a slot.
                if not (self.until_idle and slots.nothing_active()
                        and self._jump(can_fetch=False)):
                    await flow.wait_change(self.poll_timeout)
                continue
            if flow.fetching:  # a worker is topping up (see top_up)
                await flow.wait_change(self.poll_timeout)
                continue
            until_idle = self.until_idle
            generation = slots.settled
            flow.fetching = True
            try:
                messages = await self._fetch(min(free, self.fetch_batch),
                                             0.0 if until_idle else None)
            finally:
                flow.fetching = False
            if self.flow.state is not State.RUNNING:
                await self.settling.hand_back(messages)
                return
            if messages:
                self.admit(messages)
                continue
            if not until_idle:
                continue
            if not slots.nothing_active():
                if slots.settled == generation:
                    await flow.wait_change(self.poll_timeout)
            elif not self._jump(can_fetch=True):
                if slots:  # retries due later in real time
                    await flow.wait_change(self.poll_timeout)
                else:
                    self.request_stop()
                    return

    def admit(self, messages: list[Message], *, taker: bool = False) -> None:
        """Bind ``messages`` to the settling sink and admit them to the flow
        (``taker``: fetched by a worker, which takes the first itself)."""
        sink = self.settling.on_settled
        for message in messages:
            message.delivery.bind(sink)
        self.flow.admit(messages, taker=taker)
        self.count({"fetched": len(messages)})

    def may_top_up(self) -> bool:
        """Running, and enough slots free for a worker's own fetch."""
        return (self.flow.state is State.RUNNING
                and self.max_in_flight - len(self.flow.slots) >= self.top_up_min)

    async def top_up(self) -> None:
        """A worker found nothing ready: when enough slots are free and no fetch is
        running, fetch without waiting (``timeout=0``) right here - the messages are
        then taken without waking the fetch loop and idle workers first. A fetch that
        returns after the stop began is handed back."""
        flow = self.flow
        if flow.fetching or not self.may_top_up():
            return
        flow.fetching = True
        try:
            messages = await self._fetch(
                min(self.max_in_flight - len(flow.slots), self.fetch_batch), 0.0)
        finally:
            flow.fetching = False
            flow.notify()
        if self.flow.state is not State.RUNNING:
            await self.settling.hand_back(messages)
        elif messages:
            self.admit(messages, taker=True)

    async def _fetch(self, count: int, timeout: float | None) -> list[Message]:
        try:
            messages: list[Message] = await self.broker.fetch(
                self.topics, self.group, max_messages=count,
                timeout=self.poll_timeout if timeout is None else timeout)
            self.last_fetch = (time.time(), True)
            return messages
        except BrokerClosed:
            self.last_fetch = (time.time(), False)
            if self.flow.state is State.RUNNING:
                self.log.error("%s: the broker was closed while consuming; stopping", self.name)
                self.request_stop()
            return []
        except Exception:
            self.last_fetch = (time.time(), False)
            self.stats.broker_errors += 1
            self.count({"broker_errors": 1})
            self.log.exception("%s: fetch failed; retrying", self.name)
            await asyncio.sleep(min(self.poll_timeout, 1.0))
            return []

    def _jump(self, *, can_fetch: bool) -> bool:
        """Nothing active: move virtual time to the next moment something can run
        (:func:`msgpatterns.runtime.idle.jump`) and start the retries now due. True
        when progress became possible."""
        flow = self.flow
        moved = jump_or_none(self.broker, self.topics, self.group, flow.scheduler,
                             can_fetch=can_fetch, stats=self.stats,
                             count=self.count, log=self.log, name=self.name)
        if moved is None:
            return False
        fetchable, due = moved
        for message in due:
            flow.push(message)
        if due:
            flow.notify()
        return bool(due) or fetchable

