"""The I/O thread of :class:`~msgpatterns.brokers.rabbitmq.broker.RabbitMQBroker`:
pika connections are not thread-safe, so one thread owns the connection, runs the
operations other threads queue (``add_callback_threadsafe`` wakes it), serves the
connection, reconnects a lost one (until ``close()``) and, at the end, flushes the
queued acks, hands back prefetched deliveries and fails whatever still waits. A part of
the adapter: its state is the adapter's."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from msgpatterns.brokers._reconnect import RECONNECT_BACKOFF, reconnecting
from msgpatterns.brokers.rabbitmq._ack_window import AckWindow
from msgpatterns.brokers.rabbitmq._link import AUTH_ERRORS, CONNECTION_ERRORS, pika
from msgpatterns.errors import BrokerClosed, BrokerError, BrokerUnavailable
from msgpatterns.message import Message

__all__ = ["IoThread"]

log = logging.getLogger("msgpatterns.brokers.rabbitmq")

T = TypeVar("T")


class IoThread:
    """The thread that owns the connection (see the module docstring)."""

    name: str
    prefetch: int
    _params: Any
    _closed: threading.Event
    _failure: BrokerError | None
    _close_error: BaseException | None
    _ops: deque[tuple[Callable[[Any], Any], Future[Any] | None]]
    _acked: list[Any]
    _ops_lock: threading.Lock
    _wake_pending: bool
    _cond: threading.Condition
    _buffers: dict[str, deque[Message]]
    _routes: dict[str, tuple[str, str]]
    _tags: dict[str, str]
    _conn: Any
    _channel: Any
    _side: Any
    _generation: int
    _acks: AckWindow
    _thread: threading.Thread

    if TYPE_CHECKING:  # the adapter's own, elsewhere
        def _check_open(self) -> None: ...
        def _auth_failure(self, exc: BaseException) -> BrokerUnavailable: ...
        def _consume(self, channel: Any, queue: str, topic: str, group: str) -> None: ...
        def _requeue(self, channel: Any, *, message: Message, delay: float,
                     attempt: int | None = None) -> None: ...
        def _settle(self, channel: Any, r: Any) -> None: ...
        def _send_acks(self) -> None: ...

    def _loop(self) -> None:
        forever = reconnecting(CONNECTION_ERRORS, logger=log, what="RabbitMQ reconnect",
                               attempts=None, backoff=RECONNECT_BACKOFF, until=self._closed,
                               fatal=AUTH_ERRORS)
        try:
            while not self._closed.is_set():
                try:
                    if self._conn is None:
                        forever(self._reconnect)
                        continue
                    self._run_ops()
                    self._conn.process_data_events(time_limit=1.0)
                    if not self._usable():
                        raise pika.exceptions.ChannelWrongStateError(
                            "the consume channel was closed")
                except BrokerError as exc:  # authentication: give up, never retry
                    self._failure = exc
                    log.error("%s: %s", self.name, exc)
                    break
                except Exception as exc:
                    if self._closed.is_set():
                        break
                    log.warning("%s: connection lost (%r); reconnecting", self.name, exc)
                    self._lost()
        finally:
            self._shutdown()


    def _usable(self) -> bool:
        conn, channel = self._conn, self._channel
        return bool(conn is not None and conn.is_open and channel is not None
                    and channel.is_open)


    def _connect(self, retrying: Any) -> None:
        def connect() -> None:
            try:
                conn = pika.BlockingConnection(self._params)
            except AUTH_ERRORS as exc:
                raise self._auth_failure(exc) from exc
            channel = conn.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            self._conn, self._channel, self._side = conn, channel, None
            self._generation += 1
            self._acks = AckWindow()  # delivery tags are per channel

        retrying(connect)


    def _reconnect(self) -> None:
        if self._closed.is_set():
            return
        self._connect(lambda fn: fn())
        for queue, (topic, group) in list(self._routes.items()):
            self._consume(self._channel, queue, topic, group)
        log.info("%s: reconnected", self.name)


    def _lost(self) -> None:
        conn, self._conn, self._channel, self._side = self._conn, None, None, None
        self._tags.clear()  # consumer tags die with their channel
        with self._cond:
            for buffer in self._buffers.values():
                buffer.clear()  # their deliveries died with the connection
        if conn is not None:
            try:
                conn.close()
            except Exception:
                log.debug("closing the lost connection failed", exc_info=True)


    def _shutdown(self) -> None:
        """Flush, hand back, cancel and close; then fail whatever still waits."""
        try:
            if self._usable():
                self._flush_and_hand_back()
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:
                    log.debug("%s: closing the connection failed", self.name, exc_info=True)
        finally:
            self._conn = self._channel = self._side = None
            self._fail_waiting()
            with self._cond:
                for buffer in self._buffers.values():
                    buffer.clear()
                self._cond.notify_all()


    def _flush_and_hand_back(self) -> None:
        try:
            self._run_ops()
            # Deliveries received but not yet dispatched would be nacked by pika's
            # cancel (a quorum queue counts that as an attempt): buffer them first, so
            # they are handed back below with their own attempt number.
            self._conn.process_data_events(time_limit=0)
            for tag in list(self._tags):
                self._channel.basic_cancel(tag)
            self._tags.clear()
            with self._cond:
                unused = [m for buffer in self._buffers.values() for m in buffer]
                for buffer in self._buffers.values():
                    buffer.clear()
            for message in unused:  # prefetched, never handed out: not an attempt
                self._requeue(self._channel, message=message, delay=0.0,
                              attempt=message.attempt)
            self._run_ops()
        except Exception as exc:
            self._close_error = exc
            log.error("%s: closing could not flush queued acks (%r); the server "
                      "redelivers those deliveries", self.name, exc)


    def _fail_waiting(self) -> None:
        """After the I/O thread's last turn: nothing queued will ever run."""
        error: BrokerError = (BrokerUnavailable(str(self._failure))
                              if self._failure is not None
                              else BrokerClosed(f"{self.name} is closed"))
        with self._ops_lock:
            waiting, self._ops = list(self._ops), deque()
            unsent, self._acked = len(self._acked), []
            self._wake_pending = False
        for _, future in waiting:
            if future is None:
                unsent += 1
            elif future.set_running_or_notify_cancel():
                future.set_exception(error)
        if unsent:
            log.warning("%s: %d queued ack(s) were not sent (the connection was gone); "
                        "the server redelivers those deliveries", self.name, unsent)


    def _enqueue(self, fn: Callable[[Any], Any], future: Future[Any] | None) -> None:
        with self._ops_lock:
            self._ops.append((fn, future))
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            self._wake()


    def _submit(self, fn: Callable[[Any], T], *, wait: bool) -> Future[T] | None:
        """Queue ``fn(channel)`` for the I/O thread; raises BrokerClosed after close()
        (checked under the queue's lock: whatever was queued before close is flushed)."""
        future: Future[T] | None = Future() if wait else None
        wake = accepted = False
        with self._ops_lock:
            if not self._closed.is_set() and self._failure is None:
                accepted = True
                self._ops.append((fn, future))
                wake = not self._wake_pending
                self._wake_pending = True
        if not accepted:
            self._check_open()
            raise BrokerClosed(f"{self.name} is closed")
        if wake:
            self._wake()
        return future


    def _call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(channel)`` on the I/O thread and return its result."""
        if threading.current_thread() is self._thread:
            return fn(self._channel)
        future = self._submit(fn, wait=True)
        assert future is not None
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if not self._thread.is_alive():
                    self._check_open()
                    raise BrokerClosed(f"{self.name}: the I/O thread has stopped") from None


    def _wake(self) -> None:
        conn = self._conn
        if conn is None:
            return  # the loop runs the queue once reconnected
        try:
            conn.add_callback_threadsafe(self._noop)
        except Exception:
            log.debug("wake-up failed; the loop will pick the work up", exc_info=True)


    @staticmethod
    def _noop() -> None:
        pass


    def _run_ops(self) -> None:
        """Run the queued operations. An operation's failure goes to its caller; only a
        dead connection or consume channel stops the run (and triggers a reconnect).
        Acks handed over by :meth:`ack` are counted first, all at once (acks of
        distinct deliveries commute with every other operation)."""
        while True:
            with self._ops_lock:
                acked, self._acked = self._acked, []
                if not acked and not self._ops:
                    self._wake_pending = False
                    break
                op = self._ops.popleft() if self._ops else None
            for r in acked:
                self._settle(None, r)
            if op is None:
                continue
            fn, future = op
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(self._channel)
            except BaseException as exc:
                if future is not None:
                    future.set_exception(exc)
                else:
                    log.warning("%s: background operation failed: %r", self.name, exc)
                if not self._usable():
                    raise
            else:
                if future is not None:
                    future.set_result(result)
        self._send_acks()
