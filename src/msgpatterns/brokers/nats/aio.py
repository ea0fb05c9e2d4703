"""AsyncNatsJetStreamBroker: the :class:`~msgpatterns.aio.base.AsyncBroker` protocol on
NATS JetStream pull consumers, natively on the caller's event loop (nats-py is asyncio
through and through: no thread, no second loop).

The same JetStream I/O as the sync :class:`~msgpatterns.brokers.NatsJetStreamBroker`
(:mod:`msgpatterns.brokers.nats._session`, over the wire core
:mod:`msgpatterns.brokers.nats._wire` and the ack ledger
:mod:`msgpatterns.brokers.nats._acks`; nothing is copied), so the two read each other's
messages, retries and dead letters, and every guarantee of the sync adapter holds here:

* Names: stream ``stream_name(T)`` with ``T``, ``T.__retry.G`` and ``T.__dlq``; durable
  pull consumers ``G`` and ``G__retry`` with explicit acks,
  ``ack_wait = visibility_timeout`` and unlimited deliveries.
* At least once: a delivery not acked within ``visibility_timeout`` is redelivered to
  another member of the group and counts as an attempt.
* ``nack(delay)`` publishes a copy with the current headers, the next attempt and its
  due time to ``T.__retry.G`` (confirmed), then acks the original; a copy fetched
  before it is due is handed back with a native delayed NAK, never run early.
  ``dead_letter`` publishes the full record to ``T.__dlq`` (confirmed), then acks.
* An ack (or NAK) is kept until an echo queued behind it comes back on the same
  connection, and sent again after a reconnect: one written as the connection died is
  not lost with it (:class:`~msgpatterns.brokers.nats._acks.AckLedger`).
* A delivery over ``max_message_bytes``, or whose library headers are forged or
  corrupt, is dead-lettered with the reason (this one only); the consumer goes on.
* :meth:`close` hands back (NAKs) every delivery handed out and never settled - the
  group gets it again at once, not after ``ack_wait`` - waits for the acks to be
  confirmed, and closes the connection; afterwards every operation raises
  :class:`~msgpatterns.errors.BrokerClosed` and the adapter never reconnects.
* TLS (a ``tls://`` URL, ``tls_context`` or ``tls_ca_file``) means TLS or no
  connection; a password in a URL is never shown (repr, errors, logs, dead letters).

The connection is opened by the first operation (or :meth:`connect`), within
``connect_timeout`` seconds, else :class:`~msgpatterns.errors.BrokerUnavailable`
naming the last failure (at once for a TLS or authorization failure).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from msgpatterns.brokers._adapter import admin_for
from msgpatterns.brokers._aio_adapter import AsyncBrokerAdapter
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.nats._connect import tls_settings
from msgpatterns.brokers.nats._session import JetStreamSession, Receipt, nats
from msgpatterns.deadletter import DeadLetter
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import BrokerClosed, BrokerError, ConfigurationError, seconds
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES, check_max_message_bytes
from msgpatterns.message import Message

__all__ = ["AsyncNatsJetStreamBroker"]

log = logging.getLogger("msgpatterns.brokers.nats")

#: Named in the error for a message this adapter did not deliver.
_OWNER = "an AsyncNatsJetStreamBroker"

#: Seconds close() may take before it gives up on confirmations and closes the client.
_CLOSE_TIMEOUT = 15.0

T = TypeVar("T")


class AsyncNatsJetStreamBroker(JetStreamSession, AsyncBrokerAdapter):
    """The async Broker protocol on NATS JetStream (see the module docstring).

    Args: those of :class:`~msgpatterns.brokers.NatsJetStreamBroker`, with the same
    meaning and defaults.
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
        timeout = seconds(connect_timeout) or 0.0
        if timeout <= 0:
            raise ConfigurationError("connect_timeout must be positive")
        self.servers = [url] if isinstance(url, str) else list(url)
        self.visibility_timeout = float(visibility_timeout)
        self.connect_timeout = timeout
        self.max_age = max_age
        self.replicas = replicas
        self.name = name or f"msgpatterns-async-{uuid.uuid4().hex[:8]}"
        self._tls = tls_settings(self.servers, tls_context, tls_ca_file)
        self._tls_ca_file = tls_ca_file
        self._tls_context = tls_context
        self._closed = False
        self._nc: Any = None
        self._js = None
        self._connecting = asyncio.Lock()
        self._start_session()

    # -- the connection -------------------------------------------------------------------

    async def connect(self) -> None:
        """Open the connection now (the first operation does it otherwise); raises
        :class:`~msgpatterns.errors.BrokerUnavailable` within ``connect_timeout``."""
        self._check_open()
        if self._nc is not None:
            return
        async with self._connecting:
            if self._nc is None:
                self._check_open()
                nc = await self._open(self.connect_timeout)
                if self._closed:  # close() ran while connecting
                    await nc.close()
                    raise BrokerClosed(f"{self!r} is closed")
                self._nc, self._js = nc, nc.jetstream()

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (on a connected client); refused once closed; nats-py's
        errors come out as the library's own (passwords redacted)."""
        try:
            self._check_open()
            await self.connect()
        except BaseException:
            coro.close()
            raise
        try:
            return await coro
        except BrokerError:
            raise
        except (nats.errors.Error, OSError) as exc:
            raise self._failure(exc) from exc

    # -- AsyncBroker protocol -------------------------------------------------------------

    async def _publish(self, topic: str, payload: bytes, key: str | None,
                       headers: Mapping[str, str]) -> str:
        """Publish to ``topic``, confirmed by the stream (the id is also sent as
        ``Nats-Msg-Id``: a re-sent publish within the duplicate window is stored once)."""
        return await self._call(self._publish_one(topic, payload, key, headers))

    async def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Publish ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key
        and headers) to ``topic`` all at once and await every PubAck together; returns
        the message ids in order, as :meth:`publish` would. Not atomic:
        :class:`~msgpatterns.brokers.PartialPublish` says which were stored, as the
        sync adapter's ``publish_many``."""
        self._check_open()
        batch = self._batch(items)
        if not batch:
            return []
        return self._batch_ids(topic, batch, await self._call(self._publish_all(topic, batch)))

    async def subscribe(self, topic: str, group: str) -> None:
        """Create ``group``'s consumers on ``topic`` now (a fetch does it otherwise)."""
        await self._call(self._subscriptions(topic, group))

    async def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                              timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries: due retries first, then new messages
        (waiting up to ``timeout`` seconds)."""
        return await self._call(self._fetch(list(topics), group, max_messages, timeout))

    async def ack(self, message: Message) -> None:
        """Acknowledge: written to the connection, and kept until the server confirms
        it (sent again after a reconnect; :meth:`close` waits for the confirmations)."""
        r = receipt_of(message, Receipt, _OWNER)
        await self._call(self._ack(r.msg))

    async def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds, to this group only, with ``attempt + 1``,
        the original payload and the message's headers as they are now."""
        r = receipt_of(message, Receipt, _OWNER)
        await self._call(self._retry_copy(message, r, delay, None))
        await self._call(self._ack(r.msg))

    async def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Publish the record to ``T.__dlq`` (confirmed), then ack the delivery."""
        r = receipt_of(message, Receipt, _OWNER)
        await self._call(self._dead_letter_copy(r, record))
        await self._call(self._ack(r.msg))

    async def has_topic(self, topic: str) -> bool:
        """True when ``topic``'s stream exists (asking never creates it)."""
        return await self._call(self._existing(topic)) is not None

    async def close(self) -> None:
        """Hand back the deliveries never settled, wait for the acks to be confirmed
        (bounded), close the connection. Idempotent; afterwards every operation raises
        BrokerClosed."""
        if self._closed:
            return
        self._closed = True
        async with self._connecting:  # a connect under way ends first
            nc = self._nc
        if nc is None:
            return
        try:
            await asyncio.wait_for(self._close_session(), _CLOSE_TIMEOUT)
        except Exception as exc:
            if not nc.is_closed:
                try:
                    await nc.close()
                except Exception:
                    log.debug("%s: closing the connection failed", self.name,
                              exc_info=True)
            raise BrokerError(self._shown(f"closing {self!r} failed: {exc!r}")) from exc

    @property
    def closed(self) -> bool:
        return self._closed

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The (sync) admin of the ``<topic>.__dlq`` subjects
        (:class:`~msgpatterns.brokers.nats.admin.NatsJetStreamDeadLetters`) on a
        connection of its own to the same servers, opened on first use (never inside
        the event loop when wrapped in :class:`~msgpatterns.aio.AsyncDeadLetters`) and
        closed by its ``close()``."""
        self._check_open()
        return admin_for(
            "msgpatterns.brokers.nats.admin:NatsJetStreamDeadLetters",
            url=self.servers, visibility_timeout=self.visibility_timeout,
            connect_timeout=self.connect_timeout, max_age=self.max_age,
            replicas=self.replicas, name=f"{self.name}-admin",
            tls_context=self._tls_context, tls_ca_file=self._tls_ca_file,
            max_message_bytes=self.max_message_bytes)

    def __repr__(self) -> str:
        return f"AsyncNatsJetStreamBroker({self._where()!r}, name={self.name!r})"
