"""The ack side of :class:`~msgpatterns.brokers.redis.broker.RedisStreamsBroker`: acks
are queued and go to Redis in the same write as the next fetch's XREADGROUP (no round
trip of their own), from the flusher thread ``ack_flush_interval`` seconds later or as
soon as ``ack_batch`` are queued, and on ``close()``. A crash loses at most that window
of acks: those messages are redelivered (at least once), never lost.
``ack_flush_interval=0`` sends each ack at once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns.brokers.redis._wire import Receipt, ack_commands
from msgpatterns.delivery import receipt_of
from msgpatterns.message import Message

__all__ = ["AckBatching"]

#: Named in the error for a message this adapter did not deliver.
OWNER = "a RedisStreamsBroker"

log = logging.getLogger("msgpatterns.brokers.redis")


class AckBatching:
    """Queued acks, their flusher thread and the one-round-trip ack commands (a part of
    the sync adapter: its state is the adapter's)."""

    consumer: str
    ack_flush_interval: float
    ack_batch: int
    _redis: Any
    _closed: threading.Event
    _closing: bool
    _acks: list[Receipt]
    _ack_lock: threading.Lock
    _ack_full: threading.Event
    _flusher: threading.Thread | None
    _flush_error: Exception | None
    _aheads: dict[Any, Any]
    read_ahead_hold: float

    if TYPE_CHECKING:  # the adapter's own, elsewhere
        def _check_open(self) -> None: ...
        def _do(self, fn: Any, *args: Any, **kwargs: Any) -> Any: ...
        def _hand_back_ahead(self, older_than: float | None = None) -> None: ...

    def ack(self, message: Message) -> None:
        """Queue the ack (see the batching note above); :meth:`flush` sends it now."""
        receipt = message.delivery.receipt
        if type(receipt) is not Receipt:
            receipt = receipt_of(message, Receipt, OWNER)  # raises the usual error
        if self.ack_flush_interval <= 0:
            self._queue_acks((receipt,))
            return
        with self._ack_lock:  # _queue_acks inlined: the hot path of every message
            if self._closing:  # under the lock: close() flushes what got queued
                self._check_open()  # raises BrokerClosed
            acks = self._acks
            acks.append(receipt)
            if len(acks) >= self.ack_batch or self._flusher is None:
                self._wake_flusher()

    def ack_many(self, messages: Sequence[Message]) -> None:
        """:meth:`ack` for many deliveries at once (one lock, one queue append)."""
        receipts = [message.delivery.receipt for message in messages]
        if set(map(type, receipts)) != {Receipt}:  # C speed; empty or a stranger
            for message in messages:
                receipt_of(message, Receipt, OWNER)  # raises the usual error
        self._queue_acks(receipts)

    def flush(self) -> None:
        """Send every queued ack to Redis now."""
        self._check_open()
        self._flush()

    def _queue_acks(self, receipts: Sequence[Receipt]) -> None:
        """Send the acks now (no batching) or queue them for the next fetch (which
        sends them in the same write as its read) or the flusher thread, whichever
        comes first."""
        if self.ack_flush_interval <= 0:
            self._check_open()
            self._send_acks(receipts)
            return
        with self._ack_lock:
            self._check_open()  # under the lock: close() flushes whatever got queued
            self._acks.extend(receipts)
            if len(self._acks) >= self.ack_batch or self._flusher is None:
                self._wake_flusher()

    def _wake_flusher(self) -> None:
        """Ack lock held: start the flusher thread, or wake it to send a full batch now
        (off the caller's thread: a fetch coming first takes the batch along)."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_periodically,
                                             name=f"{self.consumer}-acks", daemon=True)
            self._flusher.start()
        if len(self._acks) >= self.ack_batch:
            self._ack_full.set()

    def _take_acks(self) -> list[Receipt]:
        with self._ack_lock:
            batch, self._acks = self._acks, []
        return batch

    def _requeue_acks(self, batch: list[Receipt]) -> None:
        """Put back acks taken by a fetch that failed before they surely reached Redis
        (even after close(): it flushes them once the fetch has ended)."""
        if batch:
            with self._ack_lock:
                self._acks[:0] = batch

    def _flush(self) -> None:
        batch = self._take_acks()
        if batch:
            self._send_acks(batch)

    def _flush_periodically(self) -> None:
        while not self._closed.is_set():
            self._ack_full.wait(self.ack_flush_interval)
            self._ack_full.clear()  # before taking the batch: a later set is seen
            if self._closed.is_set():
                return  # close() sends what is left
            try:
                self._flush()
                if self._aheads:
                    self._hand_back_ahead(older_than=self.read_ahead_hold)
            except Exception as exc:
                if self._closed.is_set():  # close() is waiting: it raises this
                    self._flush_error = exc
                    return
                log.exception("%s: sending acks failed; those messages will be "
                              "redelivered", self.consumer)

    def _send_acks(self, batch: Sequence[Receipt]) -> None:
        """One round trip: XACK per stream (and XDEL for retry-stream entries).
        XACK is idempotent and an acked retry entry is never read again (reads take
        new entries only), so these need no MULTI/EXEC around them."""
        self._do(self._send_commands, ack_commands(batch))

    def _send_commands(self, commands: Sequence[Sequence[Any]]) -> None:
        """One round trip for ``commands`` (no MULTI/EXEC)."""
        if len(commands) == 1:
            self._redis.execute_command(*commands[0])
            return
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        pipe.execute()
