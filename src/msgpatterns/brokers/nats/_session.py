"""The JetStream I/O both NATS adapters run: the sync
:class:`~msgpatterns.brokers.nats.broker.NatsJetStreamBroker` on its private I/O loop,
the asyncio :class:`~msgpatterns.brokers.nats.aio.AsyncNatsJetStreamBroker` on the
caller's loop. Written once, as coroutines on one event loop (nats-py is asyncio-only):
streams and durable pull consumers made on first use, fetches (due retries first,
without waiting; then new messages), each delivery judged by the wire core
(:func:`~._wire.judge`: handed out, handed back until due, or dead-lettered), confirmed
publishes, the redelivery copy and the dead letter, the acks kept until confirmed
(:class:`~._acking.ConfirmedAcks`) and the hand-back on close.

A mixin: its state is the adapter's, set by :meth:`JetStreamSession._start_session`;
``_nc``/``_js`` are the connected client and its JetStream context. Every method runs
on the loop of the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msgpatterns._extras import require
from msgpatterns._redact import hide_passwords_in
from msgpatterns.brokers import codec
from msgpatterns.brokers._batch import PartialPublish, failed, outgoing
from msgpatterns.brokers.nats import _wire as wire
from msgpatterns.brokers.nats._acking import ConfirmedAcks
from msgpatterns.brokers.nats._acks import AckLedger
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    printable,
)
from msgpatterns.headers import WireBounds
from msgpatterns.message import Message

nats = require("nats", "nats")
from nats.js import api as js_api  # noqa: E402 - after the extra check
from nats.js import errors as js_errors  # noqa: E402

from msgpatterns.brokers.nats._connect import open_connection, where  # noqa: E402

__all__ = ["Batch", "JetStreamSession", "Probe", "Receipt", "nats"]

log = logging.getLogger("msgpatterns.brokers.nats")

#: A publish_many batch: (message id, payload, wire headers) per item.
Batch = list[tuple[str, bytes, Mapping[str, str]]]

#: The client errors that mean the connection is gone (or going).
_UNAVAILABLE = (nats.errors.NoServersError, nats.errors.ConnectionClosedError,
                nats.errors.TimeoutError, OSError)


@dataclass(slots=True)
class Probe:
    """A retry consumer read with ``no_wait`` pulls answered on a private inbox."""

    request: str
    inbox: str
    sub: Any


@dataclass(slots=True)
class Receipt:
    """What a delivery's :class:`~msgpatterns.message.Message` carries back to its
    adapter."""

    msg: Any  # nats.aio.msg.Msg
    topic: str
    group: str


class JetStreamSession(ConfirmedAcks):
    """The coroutines both adapters run (see the module docstring)."""

    name: str
    servers: list[str]
    visibility_timeout: float
    max_age: float | None
    replicas: int
    max_message_bytes: int | None
    _closed: bool
    _tls: Any
    _js: Any
    _streams: set[str]
    _subscribing: asyncio.Lock
    #: the group's wire bounds, given by the adapter's base (``WireTrust``)
    wire_bounds: Callable[[str], WireBounds]

    def _start_session(self) -> None:
        """The session's state, before any connection (set by the adapter's
        constructor)."""
        self._streams = set()
        self._subs = {}
        # one maker of a group's consumers at a time: two fetches racing to make them
        # would leave one pull subscription orphaned, its deliveries waiting for ack_wait
        self._subscribing = asyncio.Lock()
        # deliveries a fetch received beyond what it was asked for (nats-py's fetch
        # hands over every late answer its subscription holds): the next fetch of the
        # slot hands them out first, close() hands them back
        self._carried = {}
        self._acks = AckLedger()  # acks the server has not confirmed yet
        self._confirming = None
        self._echo = None  # the subscription that confirms them (made on first use)
        # deliveries handed out and not settled yet: close() hands them back at once,
        # instead of leaving them to ack_wait
        self._outstanding = {}
        self._fetches = 0  # fetches running
        self._fetches_done = asyncio.Event()
        self._echo_token = 0

    # -- names, errors --------------------------------------------------------------------

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

    def _shown(self, text: str) -> str:
        """``text`` (which may quote a client error) without the URLs' passwords."""
        return hide_passwords_in(text, self.servers)

    def _where(self) -> str:
        return where(self.servers)

    def _failure(self, exc: BaseException) -> BaseException:
        """The library's error for a client error ``exc`` (``exc`` itself when it is
        one already, or not a client error): BrokerClosed once closed,
        BrokerUnavailable for a connection gone, BrokerError for the rest; passwords
        redacted."""
        if isinstance(exc, BrokerError):
            return exc
        if isinstance(exc, _UNAVAILABLE):
            if self._closed:
                return BrokerClosed(f"{self!r} is closed")
            return BrokerUnavailable(self._shown(
                f"NATS at {self._where()} unavailable: {exc!r}"))
        if isinstance(exc, nats.errors.Error):
            return BrokerError(self._shown(f"NATS operation failed: {exc!r}"))
        return exc

    # -- the connection -------------------------------------------------------------------

    async def _open(self, timeout: float) -> Any:
        """A connected client (BrokerUnavailable within ``timeout``)."""
        return await open_connection(
            self.servers, name=self.name, timeout=timeout, tls=self._tls,
            on_error=self._on_error, on_disconnect=self._on_disconnect)

    async def _on_error(self, error: Exception) -> None:
        log.warning("%s: NATS connection error: %s", self.name,
                    hide_passwords_in(repr(error), self.servers))

    async def _on_disconnect(self) -> None:
        if not self._closed:
            log.warning("%s: disconnected from NATS; reconnecting", self.name)

    async def _close_session(self) -> None:
        """:meth:`close`'s end: hand back what was never settled, wait (10 s) for the
        acks to be confirmed, flush and close the client."""
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

    # -- streams and consumers ------------------------------------------------------------

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

    async def _existing(self, topic: str) -> str | None:
        """The name of ``topic``'s stream if it exists (asking never creates it)."""
        name = self.stream_name(topic)
        if name in self._streams:
            return name
        try:
            await self._js.stream_info(name)
        except js_errors.NotFoundError:
            return None
        return name

    async def _subscriptions(self, topic: str, group: str) -> tuple[Any, Any]:
        slot = (topic, group)
        subs: tuple[Any, Any] | None = self._subs.get(slot)
        if subs is not None:
            return subs
        async with self._subscribing:
            return await self._subscribe(slot)

    async def _subscribe(self, slot: tuple[str, str]) -> tuple[Any, Any]:
        topic, group = slot
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
            probe = Probe(
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

    # -- fetching -------------------------------------------------------------------------

    async def _probe(self, probe: Probe, limit: int) -> list[Any]:
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
        """Up to ``limit`` deliveries: due retries first, then new messages (waiting up
        to ``timeout`` seconds). Counted, so that close() hands back what a fetch
        running meanwhile reads."""
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
            carried = self._carried.get((topic, group))
            while carried and len(out) < limit:
                out.extend(await self._messages([carried.pop(0)], topic, group))
            if len(out) >= limit:
                break
            # Wait only while nothing was found; then just take what is there.
            wait = 0.01 if out else max(0.01, give_up - time.monotonic())
            try:
                msgs = await main.fetch(limit - len(out), timeout=wait)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            wanted = limit - len(out)
            if len(msgs) > wanted:  # never more than asked: the rest waits its turn
                self._carried.setdefault((topic, group), []).extend(msgs[wanted:])
                msgs = msgs[:wanted]
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
        message.receipt = Receipt(msg, topic, group)
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

    # -- publishing -----------------------------------------------------------------------

    async def _send(self, topic: str, subject: str, payload: bytes,
                    headers: Mapping[str, str], dedup_id: str | None) -> None:
        """Publish to ``subject`` of ``topic``'s stream (made sure of first), confirmed
        by the stream; ``dedup_id`` goes out as ``Nats-Msg-Id``."""
        stream = await self._stream(topic)
        sent = dict(headers)
        if dedup_id is not None:
            sent["Nats-Msg-Id"] = dedup_id
        await self._js.publish(subject, payload, stream=stream, headers=sent)

    async def _publish_one(self, topic: str, payload: bytes, key: str | None,
                           headers: Mapping[str, str]) -> str:
        """Publish to ``topic``, confirmed; the message id (also its ``Nats-Msg-Id``)."""
        message_id = uuid.uuid4().hex
        sent = codec.wire_headers(headers, message_id=message_id, key=key)
        await self._send(topic, topic, payload, sent, message_id)
        return message_id

    @staticmethod
    def _batch(items: Iterable[Any]) -> Batch:
        """publish_many's items with their ids and wire headers."""
        batch: Batch = []
        for item in outgoing(items):
            message_id = uuid.uuid4().hex
            batch.append((message_id, body_bytes(item.body),
                          codec.wire_headers(item.headers, message_id=message_id,
                                             key=item.key)))
        return batch

    async def _publish_all(self, topic: str, batch: Batch) -> list[BaseException | None]:
        """Publish every message, then await the PubAcks together: each one's failure,
        or None once the stream stored it."""
        await self._stream(topic)
        outcomes = await asyncio.gather(
            *(self._send(topic, topic, payload, sent, message_id)
              for message_id, payload, sent in batch),
            return_exceptions=True)
        return [o if isinstance(o, BaseException) else None for o in outcomes]

    def _batch_ids(self, topic: str, batch: Batch,
                   results: Sequence[BaseException | None]) -> list[str]:
        """The ids of a batch whose every message was stored; else PartialPublish
        naming the stored ones (raised)."""
        ids = [mid if ok is None else None
               for (mid, _, _), ok in zip(batch, results, strict=True)]
        errors = [e for e in results if e is not None]
        if errors:
            first = self._failure(errors[0])
            error: PartialPublish = failed(topic, ids, first)
            raise error from errors[0]
        return [mid for mid, _, _ in batch]

    # -- settling -------------------------------------------------------------------------

    async def _retry_copy(self, message: Message, r: Receipt, delay: float,
                          attempt: int | None) -> None:
        """Publish the redelivery copy of ``message`` to ``r.group``'s retry subject
        (due ``delay`` seconds from now), confirmed; the caller then acks the
        original."""
        due = time.time() + delay if delay > 0 else None
        sent = codec.redelivery_headers(message, group=r.group, due_at=due, attempt=attempt,
                                        parked=due is not None)
        await self._send(r.topic, self.retry_subject(r.topic, r.group),
                         body_bytes(message.raw_body), sent, None)

    async def _dead_letter_copy(self, r: Receipt, record: DeadLetter) -> None:
        """Publish ``record`` to ``T.__dlq``, confirmed; the caller then acks."""
        await self._send(r.topic, self.dead_letter_subject(r.topic),
                         codec.dead_letter_body(record), codec.dead_letter_headers(record),
                         None)
