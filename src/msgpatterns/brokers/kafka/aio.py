"""AIOKafkaBroker: the :class:`~msgpatterns.aio.base.AsyncBroker` protocol on Kafka
with aiokafka (no worker threads).

Same topics, wire format and offset rule as the sync
:class:`~msgpatterns.brokers.KafkaBroker` - the record mapping, the malformed-record
check and the :class:`~msgpatterns.brokers.kafka._records.OffsetTracker` are the sync
adapter's own (:mod:`msgpatterns.brokers.kafka._records`), so the two read each other's
messages, retries and dead letters and the sync adapter's dead-letter admin
(``msgpatterns dlq``) manages both:

* ``T`` is read from the group's committed offsets; ``T.retry`` carries redeliveries
  (attempt header, the group they are meant for, the time they are due); ``T.DLT``
  dead letters with their full record.
* Auto-commit is off. A partition's committed offset is the first delivered offset not
  yet settled (committed at the next fetch and at :meth:`close`): out-of-order acks
  never commit past an unsettled record, so a crash redelivers everything unsettled.
* A retry or dead letter is produced and acknowledged by the cluster (idempotent
  producer) before its offset counts as settled.
* Retries are never early: a retry partition whose next record is not due is paused at
  that record until it is; another group's retries are skipped.
* Rebalances: revoked partitions commit their settled prefix; settlements of their
  in-flight messages are then ignored (the new owner redelivers them).
* Lifecycle: clients start on first use (the constructor does no I/O; a cluster that
  does not answer within ``connect_timeout`` raises
  :class:`~msgpatterns.errors.BrokerUnavailable`). :meth:`close` refuses new
  operations, waits for those in progress (a fetch in progress returns nothing it read
  after the close began), commits the settled prefixes, leaves the groups and stops the
  producer; afterwards every operation raises :class:`~msgpatterns.errors.BrokerClosed`.
* Errors: an aiokafka exception never escapes bare (it is the ``__cause__`` of a
  :class:`~msgpatterns.errors.BrokerError` or
  :class:`~msgpatterns.errors.BrokerUnavailable`).

aiokafka speaks the classic consumer-group protocol: a new group's first join waits
for the cluster's ``group.initial.rebalance.delay.ms`` (3 s on librdkafka's mock
cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from msgpatterns._callables import renamed_arguments
from msgpatterns._escape import escape_control
from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import WireTrust, admin_for
from msgpatterns.brokers._batch import failed, outgoing
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.kafka._aio_groups import (
    AsyncGroupConsumers,
    aiokafka,
    aiokafka_error,
    errors,
    wire_headers,
)
from msgpatterns.brokers.kafka._records import (
    GroupState,
    KafkaReceipt,
    bootstrap_servers,
)
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    seconds,
)
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES, check_max_message_bytes
from msgpatterns.message import Message

__all__ = ["AIOKafkaBroker", "AsyncKafkaBroker"]

log = logging.getLogger("msgpatterns.aio.kafka")

#: Named in the error for a message this adapter did not deliver.
_OWNER = "an AIOKafkaBroker"

#: Longest single wait inside a fetch: how soon a fetch notices close().
_FETCH_SLICE = 0.1

class AIOKafkaBroker(WireTrust, AsyncGroupConsumers):
    """The :class:`~msgpatterns.aio.base.AsyncBroker` protocol on Kafka (aiokafka).

    Args:
        url: ``host:port[,host:port]`` or a ``kafka://`` URL.
        consumer_config: extra ``AIOKafkaConsumer`` keyword arguments
            (``group_id``, ``enable_auto_commit`` and the listener are set here).
        producer_config: extra ``AIOKafkaProducer`` keyword arguments.
        retry_suffix: suffix of the retry topic (``<topic>.retry``).
        dead_letter_suffix: suffix of the dead-letter topic (``<topic>.DLT``).
        delivery_timeout: seconds to wait for a produced record's acknowledgement (and
            for a group to be left on close).
        connect_timeout: seconds a client may take to reach the cluster.
        max_message_bytes: the largest record (value plus headers plus key) handed
            to the handler; a larger one is dead-lettered with the reason, its value
            kept (None: no bound; see :mod:`msgpatterns.limits`).
    """

    @renamed_arguments(bootstrap_or_config="url")
    def __init__(
        self,
        url: str,
        *,
        consumer_config: Mapping[str, Any] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        retry_suffix: str = ".retry",
        dead_letter_suffix: str = ".DLT",
        delivery_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.max_message_bytes = check_max_message_bytes(max_message_bytes)
        if not isinstance(url, str) or not url:
            raise ConfigurationError("AIOKafkaBroker needs 'host:port' or a kafka:// URL, "
                                     f"got {url!r}")
        self.bootstrap_servers = bootstrap_servers(url)
        self.delivery_timeout = seconds(delivery_timeout) or 0.0
        self.connect_timeout = seconds(connect_timeout) or 0.0
        self.retry_suffix = retry_suffix
        self.dead_letter_suffix = dead_letter_suffix
        self._consumer_config = dict(consumer_config or {})
        self._producer_config = dict(producer_config or {})
        self._producer: Any = None
        self._starting = asyncio.Lock()
        self._groups: dict[str, GroupState] = {}
        self._commits: dict[str, asyncio.Task[None]] = {}  # group -> commit in flight
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._close_done = asyncio.Event()
        #: Dead-letter admins on sync brokers of their own; closed with this broker.
        self._admins: list[DeadLetterAdmin] = []

    async def __aenter__(self) -> AIOKafkaBroker:
        return self

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The sync admin of the ``<topic>.DLT`` topics
        (:class:`~msgpatterns.brokers.kafka.admin.KafkaDeadLetters`: the same topology
        and wire format), on a confluent-kafka broker of its own to the same cluster,
        closed by the admin's ``close()`` (and by this broker's); await its calls
        through :class:`~msgpatterns.aio.admin.AsyncDeadLetters`. Refused once
        closed."""
        if self._closed:
            raise BrokerClosed("AIOKafkaBroker.dead_letter_admin: the broker is closed")
        admin = admin_for("msgpatterns.brokers.kafka.admin:KafkaDeadLetters.connect",
                          self.bootstrap_servers, retry_suffix=self.retry_suffix,
                          dead_letter_suffix=self.dead_letter_suffix,
                          delivery_timeout=self.delivery_timeout,
                          connect_timeout=self.connect_timeout)
        self._admins.append(admin)
        return admin

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def aclose(self) -> None:
        """:meth:`close`, under the name every async part of msgpatterns has."""
        await self.close()

    # -- names ----------------------------------------------------------------------

    def retry_topic(self, topic: str) -> str:
        return topic + self.retry_suffix

    def dead_letter_topic(self, topic: str) -> str:
        return topic + self.dead_letter_suffix

    # -- lifecycle --------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.asynccontextmanager
    async def _operation(self, what: str) -> AsyncIterator[None]:
        """Count an operation in progress; BrokerClosed once closed; aiokafka errors
        become the library's."""
        if self._closed:
            raise BrokerClosed(f"AIOKafkaBroker.{what}: the broker is closed")
        self._active += 1
        self._idle.clear()
        try:
            yield
        except errors.KafkaError as exc:
            raise aiokafka_error(exc, what) from exc
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def _started(self, client: Any, what: str) -> Any:
        """Start an aiokafka client within ``connect_timeout``."""
        try:
            await asyncio.wait_for(client.start(), self.connect_timeout)
        except (errors.KafkaError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                await client.stop()
            raise BrokerUnavailable(
                f"Kafka at {self.bootstrap_servers} did not answer the {what} within "
                f"{self.connect_timeout:g}s ({aiokafka_error(exc, 'connect')}); check the address "
                "and that the cluster is up") from exc
        return client

    async def _ready_producer(self) -> Any:
        if self._producer is None:
            async with self._starting:
                if self._producer is None:
                    producer = aiokafka.AIOKafkaProducer(
                        bootstrap_servers=self.bootstrap_servers,
                        enable_idempotence=True,
                        request_timeout_ms=max(1000, int(self.delivery_timeout * 1000)),
                        **self._producer_config)
                    self._producer = await self._started(producer, "producer")
        return self._producer

    # -- AsyncBroker protocol ---------------------------------------------------------

    def now(self) -> float:
        return time.time()

    async def publish(self, topic: str, body: Any, *, key: str | None = None,
                      headers: Mapping[str, str] | None = None) -> str:
        """Produce to ``topic`` and wait for the cluster's acknowledgement; returns the
        message id (kept in a header, stable across retries)."""
        async with self._operation("publish"):
            message_id = uuid.uuid4().hex
            await self._produce(topic, body_bytes(body), key,
                                codec.wire_headers(headers, message_id=message_id))
            return message_id

    async def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Produce ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing`) to
        ``topic`` and await every acknowledgement together; the ids in order. Not
        atomic: :class:`~msgpatterns.brokers.PartialPublish` says which were
        acknowledged when some were not."""
        async with self._operation("publish_many"):
            producer = await self._ready_producer()
            batch = [(uuid.uuid4().hex, item) for item in outgoing(items)]
            futures: list[Any] = []
            first: BaseException | None = None
            try:
                for message_id, item in batch:
                    futures.append(await producer.send(
                        topic, body_bytes(item.body),
                        key=None if item.key is None else item.key.encode("utf-8"),
                        headers=wire_headers(codec.wire_headers(item.headers,
                                                         message_id=message_id))))
            except errors.KafkaError as exc:
                first = aiokafka_error(exc, f"produce to {topic}")
            results: list[Any] = []
            if futures:
                done = asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True),
                                        self.delivery_timeout)
                try:
                    results = await done
                except TimeoutError as exc:
                    first = first or aiokafka_error(exc, f"produce to {topic}")
                    results = [f.exception() if f.done() and not f.cancelled() else exc
                               for f in futures]
            ids = [message_id if i < len(results) and not isinstance(results[i],
                                                                     BaseException)
                   else None for i, (message_id, _) in enumerate(batch)]
            if first is None and all(ids):
                return [i for i in ids if i is not None]
            problem = first or next(r for r in results if isinstance(r, BaseException))
            raise failed(topic, ids, problem) from problem

    async def subscribe(self, topic: str, group: str) -> None:
        """Join ``group`` on ``topic`` now (a fetch does it otherwise)."""
        async with self._operation("subscribe"):
            await self._group(group, (topic,))

    async def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
                    timeout: float = 0.0) -> list[Message]:
        """Up to ``max_messages`` records of ``topics`` and their due retries, waiting
        up to ``timeout`` seconds. First starts committing (in the background, one commit
        in flight per group) what became safe to commit.

        A fetch in progress when :meth:`close` begins returns at once, and nothing it
        read after that is handed out or counted (it stays uncommitted)."""
        if isinstance(topics, str):
            topics = [topics]
        async with self._operation("fetch"):
            state = await self._group(group, tuple(topics))
            self._commit_behind(group, state)
            give_up = time.monotonic() + timeout
            while True:
                now = self.now()
                self._resume_due(state, now)
                wait = state.wait(now, max(0.0, min(give_up - time.monotonic(),
                                                    _FETCH_SLICE)))
                batch = await state.consumer.getmany(timeout_ms=int(wait * 1000),
                                                     max_records=max_messages)
                if self._closed:
                    return []  # close() began: hand out nothing read since
                out, failure = await self._accept_batch(state, group, batch, self.now())
                if failure is not None and not out:
                    raise failure
                if out or time.monotonic() >= give_up:
                    return out

    async def ack(self, message: Message) -> None:
        """Mark the record settled; the next fetch (or :meth:`close`) commits the
        contiguous settled prefix."""
        async with self._operation("ack"):
            self._settled(receipt_of(message, KafkaReceipt, _OWNER))

    async def nack(self, message: Message, delay: float = 0.0) -> None:
        """Produce the retry (original payload, current headers, ``attempt + 1``, due
        in ``delay`` seconds) to ``<topic>.retry``; once acknowledged, the record is
        settled."""
        async with self._operation("nack"):
            r = receipt_of(message, KafkaReceipt, _OWNER)
            if self._stale(r):
                log.debug("nack of %s ignored: its partition was revoked",
                          escape_control(message.id))
                return
            wire = codec.redelivery_headers(message, group=r.group,
                                            due_at=self.now() + delay)
            await self._produce(self.retry_topic(message.topic),
                                body_bytes(message.raw_body), message.key, wire)
            self._settled(r)

    async def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Produce the record to ``<topic>.DLT``; once acknowledged, it is settled."""
        async with self._operation("dead_letter"):
            r = receipt_of(message, KafkaReceipt, _OWNER)
            if self._stale(r):
                log.debug("dead letter of %s ignored: its partition was revoked",
                          escape_control(message.id))
                return
            await self._produce(self.dead_letter_topic(message.topic),
                                codec.dead_letter_body(record), message.key,
                                codec.dead_letter_headers(record))
            self._settled(r)

    async def commit(self) -> dict[tuple[str, str, int], int]:
        """Commit every group's settled prefix now; the committed position of every
        assigned partition that has one, by ``(group, topic, partition)``."""
        async with self._operation("commit"):
            out: dict[tuple[str, str, int], int] = {}
            for group, state in list(self._groups.items()):
                running = self._commits.pop(group, None)
                if running is not None:
                    await asyncio.wait([running])
                await self._commit(state, strict=True)
                for (topic, partition), tracker in state.trackers.items():
                    if tracker.committed is not None:
                        out[(group, topic, partition)] = tracker.committed
            return out

    async def close(self) -> None:
        """Wait for operations in progress, commit the settled prefixes, leave the
        groups and stop the producer (flushing it). Everything is stopped even when a
        step fails; the first failure is then raised as a
        :class:`~msgpatterns.errors.BrokerError`. Idempotent: a second call waits for
        the first."""
        if self._closed:
            await self._close_done.wait()
            return
        self._closed = True
        try:
            try:
                await asyncio.wait_for(self._idle.wait(),
                                       self.delivery_timeout + _FETCH_SLICE)
            except TimeoutError:
                log.warning("AIOKafkaBroker.close: operations still running after %gs",
                            self.delivery_timeout)
            failures: list[BaseException] = []
            for group, state in list(self._groups.items()):
                running = self._commits.pop(group, None)
                if running is not None:
                    await asyncio.wait([running])  # its outcome is logged, not raised
                try:
                    await self._commit(state, strict=True)
                except BaseException as exc:
                    failures.append(exc)
                await self._stop(state.consumer, "leave its group", failures)
            self._groups.clear()
            if self._producer is not None:
                await self._stop(self._producer, "flush", failures)
            for admin in self._admins:  # they refuse from now on
                await asyncio.to_thread(admin.close)
            self._admins.clear()
            if failures:
                first = failures[0]
                if isinstance(first, BrokerError):
                    raise first
                raise aiokafka_error(first, "close") from first
        finally:
            self._close_done.set()

    async def _stop(self, client: Any, what: str, failures: list[BaseException]) -> None:
        try:
            await asyncio.wait_for(client.stop(), self.delivery_timeout)
        except TimeoutError:
            failures.append(BrokerUnavailable(
                f"a Kafka client did not {what} within {self.delivery_timeout:g}s"))
        except Exception as exc:
            failures.append(exc)

    # -- internals --------------------------------------------------------------------

    async def _produce(self, topic: str, value: bytes | None, key: str | None,
                       headers: Mapping[str, str],
                       extra: Sequence[tuple[str, Any]] = ()) -> None:
        """Produce one record (``extra``: raw header pairs appended as they are) and
        wait for the cluster's acknowledgement."""
        producer = await self._ready_producer()
        try:
            await asyncio.wait_for(producer.send_and_wait(
                topic, value, key=None if key is None else key.encode("utf-8"),
                headers=[*wire_headers(headers), *extra]), self.delivery_timeout)
        except (errors.KafkaError, TimeoutError) as exc:
            raise aiokafka_error(exc, f"produce to {topic}") from exc

    def __repr__(self) -> str:
        return f"AIOKafkaBroker({self.bootstrap_servers!r})"


#: The default asyncio Kafka adapter (``msgpatterns.aio.AsyncKafkaBroker``).
AsyncKafkaBroker = AIOKafkaBroker
