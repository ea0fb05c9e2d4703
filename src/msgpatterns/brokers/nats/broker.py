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

nats-py is asyncio-only: the adapter runs one event loop on a private I/O thread and
every call waits for its result there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import ssl
import threading
import time
import uuid
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from msgpatterns._extras import require
from msgpatterns._redact import hide_passwords_in
from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import BrokerAdapter, admin_for
from msgpatterns.brokers._batch import failed, outgoing
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.nats import _wire as wire
from msgpatterns.brokers.nats._acking import ConfirmedAcks
from msgpatterns.brokers.nats._acks import AckLedger
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    printable,
    seconds,
)
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_max_message_bytes,
)
from msgpatterns.message import Message

nats = require("nats", "nats")
from nats.js import api as js_api  # noqa: E402 - after the extra check
from nats.js import errors as js_errors  # noqa: E402

from msgpatterns.brokers.nats._connect import (  # noqa: E402
    open_connection,
    tls_settings,
    where,
)

__all__ = ["NatsJetStreamBroker"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a NatsJetStreamBroker"

log = logging.getLogger("msgpatterns.brokers.nats")

T = TypeVar("T")

@dataclass(slots=True)
class _Probe:
    """A retry consumer read with ``no_wait`` pulls answered on a private inbox."""

    request: str
    inbox: str
    sub: Any


@dataclass(slots=True)
class _Receipt:
    msg: Any  # nats.aio.msg.Msg
    topic: str
    group: str


class NatsJetStreamBroker(ConfirmedAcks, BrokerAdapter):
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
        self._streams: set[str] = set()
        self._subs: dict[tuple[str, str], Any] = {}
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._acks = AckLedger()  # acks the server has not confirmed yet (I/O loop only)
        self._confirming: asyncio.Task[None] | None = None
        self._echo: Any = None  # the subscription that confirms them (made on first use)
        # deliveries handed out and not settled yet (I/O loop only): close() hands them
        # back at once, instead of leaving them to ack_wait
        self._outstanding: dict[str, Any] = {}
        self._fetches = 0  # fetches running on the I/O loop
        self._fetches_done = asyncio.Event()
        self._echo_token = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{self.name}-io", daemon=True
        )
        self._thread.start()
        try:
            self._nc = self._run(self._connect(connect_timeout), connect_timeout + 5)
        except BaseException:
            self._stop_loop()
            raise
        self._js = self._nc.jetstream()

    # -- names ------------------------------------------------------------------------

    @staticmethod
    def stream_name(topic: str) -> str:
        """The JetStream stream that holds ``topic``, its retries and dead letters."""
        return wire.stream_name(topic)

    @staticmethod
    def retry_subject(topic: str, group: str) -> str:
        """The subject of ``group``'s redeliveries of ``topic``."""
        return wire.retry_subject(topic, group)

    @staticmethod
    def dead_letter_subject(topic: str) -> str:
        """The subject of ``topic``'s dead letters."""
        return wire.dead_letter_subject(topic)

    # -- Broker protocol ----------------------------------------------------------------

    def _publish(self, topic: str, payload: bytes, key: str | None,
                     headers: Mapping[str, str]) -> str:
        """Publish to ``topic`` (confirmed by the server)."""
        message_id = uuid.uuid4().hex
        wire = codec.wire_headers(headers, message_id=message_id, key=key)
        self._run(self._send(topic, topic, payload, wire, message_id))
        return message_id

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
        batch = []
        for item in outgoing(items):
            message_id = uuid.uuid4().hex
            batch.append((message_id, body_bytes(item.body),
                          codec.wire_headers(item.headers, message_id=message_id,
                                             key=item.key)))
        results = self._run(self._publish_all(topic, batch))
        ids = [mid if ok is None else None for (mid, _, _), ok in zip(batch, results,
                                                                      strict=True)]
        errors = [e for e in results if e is not None]
        if errors:
            raise failed(topic, ids, errors[0]) from errors[0]
        return [mid for mid, _, _ in batch]

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
        r = receipt_of(message, _Receipt, _OWNER)
        self._submit(self._ack(r.msg))

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds, to this group only, with ``attempt + 1``,
        the original payload and the message's headers as they are now."""
        self._redeliver(message, delay, None)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Publish the record to ``T.__dlq`` (confirmed), then ack the delivery."""
        r = receipt_of(message, _Receipt, _OWNER)
        self._run(self._send(
            r.topic, self.dead_letter_subject(r.topic), codec.dead_letter_body(record),
            codec.dead_letter_headers(record), None,
        ))
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
        except (nats.errors.NoServersError, nats.errors.ConnectionClosedError,
                nats.errors.TimeoutError, OSError) as exc:
            future.cancel()  # a call that outlived its wait leaves nothing running
            if self._closed:
                raise BrokerClosed(f"{self!r} is closed") from exc
            raise BrokerUnavailable(self._shown(
                f"NATS at {self._where()} unavailable: {exc!r}")) from exc
        except nats.errors.Error as exc:
            raise BrokerError(self._shown(f"NATS operation failed: {exc!r}")) from exc

    def _shown(self, text: str) -> str:
        """``text`` (which may quote a client error) without the URLs' passwords."""
        return hide_passwords_in(text, self.servers)

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

    async def _connect(self, timeout: float) -> Any:
        return await open_connection(
            self.servers, name=self.name, timeout=timeout, tls=self._tls,
            on_error=self._on_error, on_disconnect=self._on_disconnect)

    async def _on_error(self, error: Exception) -> None:
        log.warning("%s: NATS connection error: %s", self.name,
                    hide_passwords_in(repr(error), self.servers))

    async def _on_disconnect(self) -> None:
        if not self._closed:
            log.warning("%s: disconnected from NATS; reconnecting", self.name)

    async def _shutdown(self) -> None:
        pending = [asyncio.wrap_future(f) for f in list(self._pending)]
        if pending:
            await asyncio.wait(pending, timeout=5)
        await self._hand_back_outstanding()
        confirming = self._confirming
        if confirming is not None and not confirming.done():
            await asyncio.wait([confirming], timeout=10)
            if not confirming.done():
                confirming.cancel()
                log.warning("%s: %d acks not confirmed by the server at close(); those "
                            "deliveries may come back after ack_wait", self.name,
                            len(self._acks))
        if not self._nc.is_closed:
            await self._nc.flush(timeout=5)
            await self._nc.close()

    # -- internals (on the I/O loop) ------------------------------------------------------

    async def _stream(self, topic: str) -> str:
        if not wire.SUBJECT.match(topic) or ".__" in topic:
            raise ConfigurationError(
                f"topic {topic!r} is not a plain NATS subject (tokens of letters, digits, "
                "'-' and '_' separated by dots, no wildcards, no '.__' part)"
            )
        name = self.stream_name(topic)
        if name in self._streams:
            return name
        subjects = [topic, f"{topic}.__retry.*", self.dead_letter_subject(topic)]
        config = js_api.StreamConfig(
            name=name, subjects=subjects, num_replicas=self.replicas,
            max_age=self.max_age, storage=js_api.StorageType.FILE,
        )
        try:
            await self._js.add_stream(config)
        except js_errors.BadRequestError as exc:
            # Exists with another config: keep it, as long as it holds our subjects.
            info = await self._js.stream_info(name)
            missing = set(subjects) - set(info.config.subjects or [])
            if missing:
                raise BrokerError(
                    f"stream {name} exists without subjects {sorted(missing)}"
                ) from exc
        self._streams.add(name)
        return name

    async def _subscriptions(self, topic: str, group: str) -> tuple[Any, Any]:
        slot = (topic, group)
        subs = self._subs.get(slot)
        if subs is None:
            stream = await self._stream(topic)
            durable = wire.safe_name(group)
            main = await self._js.pull_subscribe(
                topic, durable=durable, stream=stream, config=self._consumer_config(topic),
            )
            retry_subject = self.retry_subject(topic, group)
            retry_durable = f"{durable}__retry"
            await self._js.add_consumer(stream, self._consumer_config(retry_subject),
                                        durable_name=retry_durable)
            inbox = self._nc.new_inbox()
            probe = _Probe(
                request=f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{retry_durable}",
                inbox=inbox, sub=await self._nc.subscribe(inbox),
            )
            subs = self._subs[slot] = (probe, main)
        return subs

    def _consumer_config(self, subject: str) -> Any:
        return js_api.ConsumerConfig(
            filter_subject=subject,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            deliver_policy=js_api.DeliverPolicy.ALL,
            ack_wait=self.visibility_timeout, max_deliver=-1, max_ack_pending=-1,
        )

    async def _probe(self, probe: _Probe, limit: int) -> list[Any]:
        """What the retry consumer has ready now, without waiting: a ``no_wait`` pull
        (no expiry), answered at once with the messages or a 404/408 status."""
        request = json.dumps({"batch": limit, "no_wait": True}).encode()
        await self._nc.publish(probe.request, request, reply=probe.inbox)
        msgs: list[Any] = []
        while len(msgs) < limit:
            try:
                msg = await probe.sub.next_msg(timeout=5)
            except (TimeoutError, nats.errors.TimeoutError):
                break  # a late answer waits in the inbox for the next probe
            if msg.headers and msg.headers.get("Status"):
                break  # 404 no messages / 408 request expired: the request is over
            msgs.append(msg)
        return msgs

    async def _fetch(self, topics: list[str], group: str, limit: int,
                     timeout: float) -> list[Message]:
        if self._closed:  # close() began after this fetch was sent: it reads nothing
            raise BrokerClosed(f"{self!r} is closed")
        self._fetches += 1
        self._fetches_done.clear()
        try:
            return await self._fetch_from(topics, group, limit, timeout)
        finally:
            self._fetches -= 1
            if not self._fetches:
                self._fetches_done.set()

    async def _fetch_from(self, topics: list[str], group: str, limit: int,
                          timeout: float) -> list[Message]:
        out: list[Message] = []
        subs = [(topic, await self._subscriptions(topic, group)) for topic in topics]
        # Due retries first, without waiting; then new messages.
        for topic, (probe, _) in subs:
            if len(out) < limit:
                out.extend(await self._messages(
                    await self._probe(probe, limit - len(out)), topic, group))
        give_up = time.monotonic() + max(timeout, 0.01)
        for topic, (_, main) in subs:
            if len(out) >= limit:
                break
            # Wait only while nothing was found; then just take what is there.
            wait = 0.01 if out else max(0.01, give_up - time.monotonic())
            try:
                msgs = await main.fetch(limit - len(out), timeout=wait)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            out.extend(await self._messages(msgs, topic, group))
        return out

    async def _messages(self, msgs: list[Any], topic: str, group: str) -> list[Message]:
        out = []
        for msg in msgs:
            message = await self._message(msg, topic, group)
            if message is not None:
                out.append(message)
        return out

    async def _message(self, msg: Any, topic: str, group: str) -> Message | None:
        """The Message for ``msg``; None when it was handed back (not due yet) or
        dead-lettered (unreadable)."""
        meta = msg.metadata
        stream_seq = meta.sequence.stream
        verdict = wire.judge(
            msg.data, msg.headers, topic=topic, stream=meta.stream, sequence=stream_seq,
            deliveries=meta.num_delivered, now=time.time(), limit=self.max_message_bytes,
            published=meta.timestamp.timestamp() if meta.timestamp is not None else None,
            bounds=self.wire_bounds(group))
        if verdict.problem is not None:  # dead-lettered: this one only
            await self._bury_malformed(msg, topic, group, f"{meta.stream}:{stream_seq}",
                                       verdict.problem, too_large=verdict.too_large)
            return None
        if verdict.wait is not None:
            await msg.nak(delay=verdict.wait)  # the server brings it back when due
            return None
        message = verdict.message
        assert message is not None
        message.receipt = _Receipt(msg, topic, group)
        self._outstanding[msg.reply] = msg
        return message

    async def _bury_malformed(self, msg: Any, topic: str, group: str, fallback_id: str,
                              problem: str, *, too_large: bool = False) -> None:
        """Dead-letter one delivery whose library headers are unusable, or that is over
        ``max_message_bytes`` (``too_large``; ``problem`` says why), keeping its body
        and its user headers; then ack it."""
        record = wire.malformed_letter(
            msg.data, msg.headers, topic=topic, group=group, fallback_id=fallback_id,
            sequence=msg.metadata.sequence.stream, problem=problem, too_large=too_large,
            now=time.time())
        log.error("%s: dead-lettering %r of %s: %s", self.name, record.message.id, topic,
                  printable(problem))
        await self._send(topic, self.dead_letter_subject(topic),
                         codec.dead_letter_body(record), codec.dead_letter_headers(record),
                         None)
        await self._ack(msg)

    def _redeliver(self, message: Message, delay: float, attempt: int | None) -> None:
        r = receipt_of(message, _Receipt, _OWNER)
        due = time.time() + delay if delay > 0 else None
        wire = codec.redelivery_headers(message, group=r.group, due_at=due, attempt=attempt,
                                        parked=due is not None)
        self._run(self._send(r.topic, self.retry_subject(r.topic, r.group),
                                body_bytes(message.raw_body), wire, None))
        self._submit(self._ack(r.msg))

    async def _send(self, topic: str, subject: str, payload: bytes,
                       headers: Mapping[str, str], dedup_id: str | None) -> None:
        stream = await self._stream(topic)
        wire = dict(headers)
        if dedup_id is not None:
            wire["Nats-Msg-Id"] = dedup_id
        await self._js.publish(subject, payload, stream=stream, headers=wire)

    def has_topic(self, topic: str) -> bool:
        """True when ``topic``'s stream exists (asking never creates it)."""
        return self._run(self._existing(topic)) is not None

    async def _existing(self, topic: str) -> str | None:
        name = self.stream_name(topic)
        if name in self._streams:
            return name
        try:
            await self._js.stream_info(name)
        except js_errors.NotFoundError:
            return None
        return name

    async def _publish_all(self, topic: str, batch: Sequence[tuple[str, bytes,
                           Mapping[str, str]]]) -> list[BaseException | None]:
        """Publish every message, then await the PubAcks together: each one's failure,
        or None once the stream stored it."""
        await self._stream(topic)
        outcomes = await asyncio.gather(
            *(self._send(topic, topic, payload, wire, message_id)
              for message_id, payload, wire in batch),
            return_exceptions=True)
        return [o if isinstance(o, BaseException) else None for o in outcomes]

    def _where(self) -> str:
        return where(self.servers)

    def __repr__(self) -> str:
        return f"NatsJetStreamBroker({self._where()!r}, name={self.name!r})"
