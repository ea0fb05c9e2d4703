"""The acks of the NATS adapters (:class:`~msgpatterns.brokers.nats.broker.NatsJetStreamBroker`
and :class:`~msgpatterns.brokers.nats.aio.AsyncNatsJetStreamBroker`), confirmed.

An ack (or a NAK) is a plain publish the client writes and forgets: one written as the
connection died is lost with it. Each is kept in an :class:`~._acks.AckLedger` until an
echo queued behind it comes back on the same connection, and sent again after a
reconnect. On ``close()`` every delivery handed out and never settled is NAKed (back to
the group at once, not after ``ack_wait``). A part of the adapter, run on the loop of
its client (the sync adapter's I/O loop, the caller's loop for the asyncio one): its
state is the adapter's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from msgpatterns._extras import require
from msgpatterns.brokers.nats._acks import AckLedger

nats = require("nats", "nats")

__all__ = ["ConfirmedAcks"]

log = logging.getLogger("msgpatterns.brokers.nats")

#: Seconds the echo that confirms acks may take to come back, and the pause before trying
#: again while the client reconnects.
_CONFIRM_TIMEOUT = 5.0
_CONFIRM_PAUSE = 0.05
_NAK = b"-NAK"  # JetStream's negative ack: redeliver now


class ConfirmedAcks:
    """Acks kept until confirmed; the hand-back on close (see the module docstring)."""

    name: str
    _nc: Any
    _acks: AckLedger
    _confirming: asyncio.Task[None] | None
    _echo: Any
    _outstanding: dict[str, Any]
    _fetches: int
    _fetches_done: asyncio.Event
    _echo_token: int
    _subs: dict[tuple[str, str], Any]
    _carried: dict[tuple[str, str], list[Any]]

    def _connection(self) -> int:
        """Which connection the client is on (its reconnect count)."""
        return int(self._nc.stats["reconnects"])

    async def _ack(self, msg: Any) -> None:
        """Ack ``msg`` and keep the ack until the server confirms it."""
        connection = self._connection()
        await msg.ack()
        self._outstanding.pop(msg.reply, None)
        self._acks.sent(msg.reply, connection)
        task = self._confirming
        if task is None or task.done():
            self._confirming = asyncio.get_running_loop().create_task(self._confirm_acks())

    async def _hand_back_outstanding(self) -> None:
        """:meth:`close`: NAK every delivery handed out and never settled (not run yet,
        or settled after ``close()`` and refused), so the group gets it again at once
        rather than after ``ack_wait``; it counts as a delivery, like any redelivery.
        The NAKs are confirmed as the acks are; one that cannot be sent leaves its
        delivery to ``ack_wait`` (none is lost)."""
        if self._fetches:  # what they read is handed out, then handed back here
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._fetches_done.wait(), _CONFIRM_TIMEOUT)
        confirming = self._confirming
        if confirming is not None and not confirming.done():  # one echo reader at a time
            await asyncio.wait([confirming], timeout=_CONFIRM_TIMEOUT)
        if confirming is None or confirming.done():
            # what the server sent before this echo (a pull request answered late) is
            # in our buffers when it comes back
            with contextlib.suppress(Exception):
                await self._echo_round()
        outstanding, self._outstanding = self._outstanding, {}
        connection = self._connection()
        for msg in [*outstanding.values(), *self._buffered()]:
            try:
                await msg.nak()
            except Exception:  # the connection is gone: ack_wait brings it back
                log.warning("%s: could not hand back a delivery on close(); it comes "
                            "back after visibility_timeout", self.name, exc_info=True)
                continue
            self._acks.sent(msg.reply, connection, _NAK)
        if len(self._acks) and (self._confirming is None or self._confirming.done()):
            self._confirming = asyncio.get_running_loop().create_task(self._confirm_acks())

    def _buffered(self) -> list[Any]:
        """Deliveries that reached this client after their fetch ended (a pull
        request answered late), or that a fetch received beyond what it was asked for:
        the next fetch would have read them; on close they are handed back. nats-py has
        no public way to take them off a pull subscription."""
        found: list[Any] = [msg for carried in self._carried.values() for msg in carried]
        self._carried.clear()
        for probe, main in self._subs.values():
            for sub in (probe.sub, getattr(main, "_sub", None)):
                queue = getattr(sub, "_pending_queue", None)
                while queue is not None and not queue.empty():
                    msg = queue.get_nowait()
                    if msg.reply and msg.reply.startswith("$JS.ACK."):  # not a status
                        found.append(msg)
        return found

    async def _confirm_acks(self) -> None:
        """Until every ack sent is confirmed: send again those of a connection that is
        gone, then an echo - a message to our own subscription, queued behind the acks
        (nats-py writes a PING ahead of what it has queued, so a PONG proves nothing).
        Its return on the same connection means the server received every ack sent
        before it. Ends when the ledger is empty or the client is closed."""
        acks, nc = self._acks, self._nc
        while len(acks) and not nc.is_closed:
            connection = self._connection()
            try:
                for reply, payload in acks.to_resend(connection):
                    await nc.publish(reply, payload)
                    acks.sent(reply, connection, payload)
                snapshot = acks.snapshot()
                await self._echo_round()
            except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError, OSError):
                await asyncio.sleep(_CONFIRM_PAUSE)  # reconnecting: try again
                continue
            acks.confirmed(snapshot, connection, self._connection())

    async def _echo_round(self) -> None:
        """Send a message to our own subscription and wait for it to come back: the
        server has then received what we sent before it, and we have received what it
        sent us before it. One caller at a time (the confirming task, or close())."""
        nc = self._nc
        if self._echo is None:
            self._echo = await nc.subscribe(nc.new_inbox())
        self._echo_token += 1
        token = str(self._echo_token).encode()
        await nc.publish(self._echo.subject, token)
        while (await self._echo.next_msg(timeout=_CONFIRM_TIMEOUT)).data != token:
            pass  # the echo of an earlier round that timed out
