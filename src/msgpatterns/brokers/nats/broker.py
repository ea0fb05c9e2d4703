"""NatsJetStreamBroker: the Broker protocol on NATS JetStream pull consumers (nats-py).

Names, for a topic ``T`` (a NATS subject) and a consumer group ``G``:

* stream ``stream_name(T)`` holds three kinds of subject: ``T`` (what producers
  publish), ``T.__retry.G`` (redeliveries meant for ``G`` only) and ``T.__dlq`` (dead
  letters of every group, each carrying the full record).
* durable pull consumers ``G`` (filter ``T``) and ``G__retry`` (filter ``T.__retry.G``),
  with explicit acks, ``ack_wait = visibility_timeout`` and unlimited deliveries: the
  :class:`~msgpatterns.RetryPolicy` decides when a message becomes a dead letter.

Guarantees:

* At least once: a delivery not acked within ``visibility_timeout`` (its consumer died)
  is redelivered by the server to another member of the group, and counts as an attempt
  (the stream's delivery count).
* ``nack(delay)`` publishes a copy with the message's current headers, the next attempt
  number and its due time to ``T.__retry.G`` (confirmed by the server), then acks the
  original: a crash between the two gives a duplicate, never a loss. A copy fetched
  before it is due is handed back with a native delayed NAK, never run early.
* ``message.id`` is the publisher's id (the library's id header, also sent as
  ``Nats-Msg-Id`` so JetStream drops a re-sent publish within its duplicate window),
  or ``"<stream>:<sequence>"`` for a foreign message without one: stable across
  redeliveries and retries, unique across messages.
* After :meth:`close` every operation raises :class:`~msgpatterns.errors.BrokerClosed`
  and the adapter never reconnects; queued acks are flushed to the server first.

* A fetch hands out at most ``max_messages`` deliveries (nats-py's pull fetch can
  return more: every late answer its subscription holds); the rest go first to the
  next fetch, or back to the group on :meth:`close`.

nats-py is asyncio-only: the adapter runs one event loop on a private I/O thread and
every call waits for its result there. The I/O itself is the JetStream session
(:mod:`msgpatterns.brokers.nats._session`) that the asyncio adapter,
:class:`~msgpatterns.brokers.nats.aio.AsyncNatsJetStreamBroker`, runs on the caller's
loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
import uuid
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from msgpatterns.brokers._adapter import BrokerAdapter, admin_for
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.nats._connect import tls_settings
from msgpatterns.brokers.nats._session import JetStreamSession, Receipt
from msgpatterns.brokers.nats._session import nats as nats
from msgpatterns.deadletter import DeadLetter
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    ConfigurationError,
    seconds,
)
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_max_message_bytes,
)
from msgpatterns.message import Message

__all__ = ["NatsJetStreamBroker"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a NatsJetStreamBroker"

log = logging.getLogger("msgpatterns.brokers.nats")

T = TypeVar("T")

class NatsJetStreamBroker(JetStreamSession, BrokerAdapter):
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on NATS JetStream.

    Args:
        url: ``nats://host:port`` or ``tls://host:port`` (comma-separated for a
            cluster) or a list of them; a password in it is never shown (repr, errors,
            logs, dead letters).
        visibility_timeout: seconds a delivery may stay unacked before the server gives
            it to another consumer of the group (JetStream's ``ack_wait``).
        connect_timeout: seconds to wait for the server when connecting: after that
            (or at once on a TLS or authorization failure) the constructor raises
            :class:`~msgpatterns.errors.BrokerUnavailable` naming the last failure.
        max_age: seconds the stream keeps messages (None: until its limits say so).
        replicas: stream replicas (1 for a single server).
        tls_context: the :class:`ssl.SSLContext` to connect with (client certificate,
            CA, verification); implies TLS.
        tls_ca_file: a CA bundle to verify the server with (a verifying default
            context); implies TLS.
        max_message_bytes: the largest delivery (body plus headers) handed to the
            handler; a larger one is dead-lettered with the reason (a
            :class:`~msgpatterns.limits.MessageTooLarge`), its body kept (None: no
            bound; see :mod:`msgpatterns.limits`).

    TLS (a ``tls://`` URL, ``tls_context`` or ``tls_ca_file``) means TLS or no
    connection: a server that does not require TLS in its INFO is refused before any
    credentials are sent, and a failed verification raises an error naming the SSL
    problem.
    """

    def __init__(
        self,
        url: str | Sequence[str] = "nats://127.0.0.1:4222",
        *,
        visibility_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        max_age: float | None = None,
        replicas: int = 1,
        name: str | None = None,
        tls_context: ssl.SSLContext | None = None,
        tls_ca_file: str | None = None,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.max_message_bytes = check_max_message_bytes(max_message_bytes)
        if visibility_timeout <= 0:
            raise ConfigurationError("visibility_timeout must be positive")
        connect_timeout = seconds(connect_timeout) or 0.0
        if connect_timeout <= 0:
            raise ConfigurationError("connect_timeout must be positive")
        self.servers = [url] if isinstance(url, str) else list(url)
        self.visibility_timeout = float(visibility_timeout)
        self.max_age = max_age
        self.replicas = replicas
        self.name = name or f"msgpatterns-{uuid.uuid4().hex[:8]}"
        self._tls = tls_settings(self.servers, tls_context, tls_ca_file)
        self._closed = False
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._start_session()  # its state is used on the I/O loop only
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{self.name}-io", daemon=True
        )
        self._thread.start()
        try:
            self._nc = self._run(self._open(connect_timeout), connect_timeout + 5)
        except BaseException:
            self._stop_loop()
            raise
        self._js = self._nc.jetstream()

    # -- Broker protocol ----------------------------------------------------------------

    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        """Publish to ``topic`` (confirmed by the server)."""
        return self._run(self._publish_one(topic, payload, key, headers))

    @property
    def closed(self) -> bool:
        return self._closed

    def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Publish ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key
        and headers) to ``topic`` all at once and await every PubAck together; returns
        the message ids in order, as :meth:`publish` would.

        Not atomic: each message is acknowledged by the stream on its own. If any is
        not, :class:`~msgpatterns.brokers.PartialPublish` says which were (those are
        stored; the others may or may not be). Each carries its id as ``Nats-Msg-Id``,
        so re-publishing within the stream's duplicate window stores it once."""
        batch = self._batch(items)
        return self._batch_ids(topic, batch, self._run(self._publish_all(topic, batch)))

    def subscribe(self, topic: str, group: str) -> None:
        """Create ``group``'s consumers on ``topic`` now (a fetch does it otherwise)."""
        self._run(self._subscriptions(topic, group))

    def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                       timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries: due retries first, then new messages
        (waiting up to ``timeout`` seconds)."""
        return self._run(self._fetch(list(topics), group, max_messages, timeout),
                         timeout + 30)

    def ack(self, message: Message) -> None:
        """Acknowledge; the ack is sent on the I/O thread without waiting. Until the
        server confirms it (an echo queued behind it came back on the same connection),
        it is kept and sent again after a reconnect: an ack written as the connection
        died is not lost with it. :meth:`close` waits for the confirmations (10 s)."""
        r = receipt_of(message, Receipt, _OWNER)
        self._submit(self._ack(r.msg))

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds, to this group only, with ``attempt + 1``,
        the original payload and the message's headers as they are now."""
        r = receipt_of(message, Receipt, _OWNER)
        self._run(self._retry_copy(message, r, delay, None))
        self._submit(self._ack(r.msg))

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Publish the record to ``T.__dlq`` (confirmed), then ack the delivery."""
        r = receipt_of(message, Receipt, _OWNER)
        self._run(self._dead_letter_copy(r, record))
        self._submit(self._ack(r.msg))

    def close(self) -> None:
        """Flush queued acks, then close the connection and the I/O thread. Idempotent;
        afterwards every operation raises BrokerClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            fut.result(timeout=10)
        except Exception as exc:
            raise BrokerError(f"closing {self!r} failed: {exc}") from exc
        finally:
            self._stop_loop()

    def has_topic(self, topic: str) -> bool:
        """True when ``topic``'s stream exists (asking never creates it)."""
        return self._run(self._existing(topic)) is not None

    # -- dead-letter admin ----------------------------------------------------------------

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The admin of the ``<topic>.__dlq`` subjects
        (:class:`~msgpatterns.brokers.nats.admin.NatsJetStreamDeadLetters`), on this
        broker's connection."""
        return admin_for("msgpatterns.brokers.nats.admin:NatsJetStreamDeadLetters", self)

    # -- steps the dead-letter admin builds on -------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on this broker's I/O loop (nats-py is asyncio-only) and wait for
        it; refused once closed; nats-py's errors come out as the library's own."""
        return self._run(coro, timeout)

    @property
    def jetstream(self) -> Any:
        """The JetStream context of this broker's connection (use it on the I/O loop,
        through :meth:`run`)."""
        return self._js

    async def existing_stream(self, topic: str) -> str | None:
        """The name of ``topic``'s stream if it exists (asking never creates it); on
        the I/O loop."""
        return await self._existing(topic)

    async def send(self, topic: str, subject: str, payload: bytes,
                   headers: Mapping[str, str]) -> None:
        """Publish to ``subject`` of ``topic``'s stream (made sure of first), confirmed
        by the stream; on the I/O loop."""
        await self._send(topic, subject, payload, headers, None)

    # -- the I/O thread -------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the I/O loop and wait for it; client errors become
        BrokerError subclasses."""
        if self._closed:
            coro.close()
            raise BrokerClosed(f"{self!r} is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except BrokerError:
            raise
        except (nats.errors.Error, OSError) as exc:
            future.cancel()  # a call that outlived its wait leaves nothing running
            raise self._failure(exc) from exc

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start ``coro`` on the I/O loop without waiting (its failure is logged)."""
        if self._closed:
            coro.close()
            raise BrokerClosed(f"{self!r} is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: Any) -> None:
        with self._lock:
            self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("%s: an ack was not sent (the message will be redelivered): %r",
                        self.name, future.exception())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if pending:
            await asyncio.wait(pending, timeout=5)
        await self._close_session()

    def __repr__(self) -> str:
        return f"NatsJetStreamBroker({self._where()!r}, name={self.name!r})"
