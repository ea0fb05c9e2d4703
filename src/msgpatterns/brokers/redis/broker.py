"""RedisStreamsBroker: the Broker protocol on Redis Streams consumer groups (redis-py).

Keys, for a stream ``S`` (a topic) and a consumer group ``G``:

* ``S`` - the stream producers add to; every group reads all of it (XREADGROUP).
* ``S:retry:G`` - redeliveries meant for ``G`` only: nacked messages whose delay is
  due, and replays. Its entries are deleted once settled.
* ``S:delayed:G`` - a sorted set of ``G``'s delayed retries, scored by due time.
* ``S:dlq`` - dead letters of every group, each entry carrying the full record.

Guarantees:

* At least once: a delivery stays in the group's pending list until it is acked,
  moved to the retry path, or dead-lettered. A delivery left pending longer than
  ``visibility_timeout`` (its consumer died) is claimed by another consumer with
  XAUTOCLAIM.
* The attempt number is durable: the stream's delivery count for crash redeliveries,
  plus the attempt header written when a nacked message is re-added.
* Moving a message (nack, due retry, dead letter) is one Lua script: the copy is
  written and the original acked together or not at all, so a crash never loses or
  duplicates it. A settlement from a consumer whose delivery was claimed by another
  consumer meanwhile does nothing.
* Retries are never delivered before their delay (Redis server time) and reach only
  the group that nacked them.
* Acks are batched: :meth:`RedisStreamsBroker.ack` queues the ack of a settled
  delivery (nothing else is ever acked), and queued acks go to Redis in the same write
  as the next fetch's XREADGROUP (no round trip of their own), from the flusher thread
  ``ack_flush_interval`` seconds later or as soon as ``ack_batch`` are queued, and on
  :meth:`RedisStreamsBroker.close`. A crash loses at most that window of acks: those
  messages are redelivered (at least once), never lost. ``ack_flush_interval=0`` sends
  each ack at once.
* Read-ahead: under a backlog (a read filled its count, soon after the previous one)
  the next XREADGROUP is written right away, without BLOCK and with the queued acks,
  and the next fetch takes its reply: Redis prepares the next batch while the handlers
  run. Those entries are pending deliveries of this consumer like the fetched ones;
  :meth:`RedisStreamsBroker.close` hands back any that no fetch took, and so does the
  flusher thread after ``read_ahead_hold`` seconds (a consumer stopped without closing
  its broker). ``read_ahead=False`` turns it off (it is off with
  ``ack_flush_interval=0``).

* Ids: ``message.id`` is ``"<topic>/<entry id>"`` (what :meth:`publish` returns):
  unique across messages and streams, and kept by every redelivery (a retry copy
  carries the original id in a header), or the id a publisher set in that header.
* Entries that cannot be decoded (a field name that is not UTF-8, a ``headers`` field
  that is not a JSON object of strings, a library header of the wrong type) are
  dead-lettered on their own with a reason; the dead letter's body holds the raw
  fields as JSON ``[name, value]`` pairs (bytes decoded with ``surrogateescape``).
  The rest of the batch is delivered.
* Lifecycle: after :meth:`close` (which flushes queued acks or raises
  :class:`~msgpatterns.errors.BrokerError`), every operation raises
  :class:`~msgpatterns.errors.BrokerClosed` at once and nothing reconnects. A fetch
  blocked in XREADGROUP when :meth:`close` is called is woken (CLIENT UNBLOCK) and
  hands back anything it read, so nothing stays pending under the closed consumer.
* Errors: a connection failure that outlasts the reconnect attempts raises
  :class:`~msgpatterns.errors.BrokerUnavailable` (auth failures at once, never
  retried), any other Redis error :class:`~msgpatterns.errors.BrokerError`; the
  redis-py exception is the ``__cause__``.
* A lost consumer group (a Redis without persistence restarted empty, or
  ``XGROUP DESTROY``) is re-created with MKSTREAM at ``0`` and consumption resumes;
  the loss is logged as an error (its pending deliveries are gone with it; the
  stream's surviving entries are read again: at least once, never lost).

Trimming: ``maxlen`` caps ``S`` on publish (approximate ``MAXLEN ~``). Redis trims
regardless of consumer groups, so a cap below the backlog drops unread or pending
entries (logged when XAUTOCLAIM reports them); leave it None (the default) or size it
well above the longest backlog. Retry streams hold only unsettled entries; the
dead-letter stream is trimmed only if ``dead_letter_maxlen`` is set.

With Redis Cluster, put the topic in a hash tag (``{orders}``) so that a stream and its
retry, delayed and dead-letter keys share a slot (the scripts touch several of them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from msgpatterns._callables import renamed_arguments
from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import BrokerAdapter, admin_for
from msgpatterns.brokers._batch import outgoing
from msgpatterns.brokers._reconnect import reconnect_backoff, reconnecting
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.redis import _wire as wire
from msgpatterns.brokers.redis._acks import OWNER, AckBatching
from msgpatterns.brokers.redis._groups import GroupUpkeep
from msgpatterns.brokers.redis._link import (
    AUTH_ERRORS,
    CONNECTION_ERRORS,
    NoGroup,
    StreamsSettings,
    own_pending,
    redis,
    redis_error,
)
from msgpatterns.brokers.redis._reads import Ahead, Read, StreamReads
from msgpatterns.brokers.redis._wire import EntryDecoder, Receipt
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import BrokerClosed, BrokerError
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES
from msgpatterns.message import Message

__all__ = ["RedisStreamsBroker"]

log = logging.getLogger("msgpatterns.brokers.redis")


class RedisStreamsBroker(StreamsSettings, AckBatching, StreamReads, GroupUpkeep,
                         BrokerAdapter):
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on Redis Streams.

    Recovery time after a consumer dies: its deliveries become claimable
    ``visibility_timeout`` seconds after their last delivery; the next fetch that looks
    (at most ``claim_interval`` later) claims a batch, and every following fetch claims
    another while stale entries remain (a fetch returns claimed deliveries first), so
    the backlog comes back at the rate the consumer processes it: about
    ``visibility_timeout + claim_interval + orphans / processing rate``. At the
    defaults (30 min, 30 s) and 1,000 messages/s, 5,000 orphans are back about 30.5
    minutes after the crash, 5 s of which is the backlog itself.

    Args:
        url: a ``redis://`` URL, or a ``redis.Redis`` client (shared; not closed by
            :meth:`close`). The old keyword ``client_or_url=`` still works.
        consumer: this consumer's name in its groups (default: host, pid and a random
            suffix, so a restarted process is a new consumer).
        visibility_timeout: seconds a delivery may stay unsettled before another
            consumer claims it. Keep it above the Consumer's ``ack_timeout``.
        claim_interval: how often (seconds) a fetch looks for stale deliveries
            (default: a quarter of the visibility timeout, at most 30 s).
        maxlen: approximate cap of each topic stream on publish (None: no trimming).
        dead_letter_maxlen: approximate cap of each dead-letter stream (None).
        start_id: where a new group starts reading: ``"0"`` (the whole stream, the
            default) or ``"$"`` (only messages added from now on).
        ack_flush_interval: longest an ack waits in the batch (seconds; 0: no batch).
        ack_batch: queued acks that wake the flusher at once (a backstop: a fetch
            takes every queued ack along with its read).
        promote_interval: how often a fetch moves due delayed retries into the retry
            stream (seconds; a retry is at most this late).
        read_ahead: read the next batch ahead under a backlog (see the module
            docstring).
        read_ahead_hold: seconds a read-ahead no fetch takes stays pending under this
            consumer before the flusher hands it back.
        max_message_bytes: the largest entry (body plus other fields) handed to the
            handler; a larger one is dead-lettered with the reason, its raw body kept
            (None: no bound; see :mod:`msgpatterns.limits`).
    """

    @renamed_arguments(client_or_url="url")
    def __init__(
        self,
        url: Any,
        *,
        consumer: str | None = None,
        visibility_timeout: float = 1800.0,
        claim_interval: float | None = None,
        maxlen: int | None = None,
        dead_letter_maxlen: int | None = None,
        start_id: str = "0",
        ack_flush_interval: float = 0.05,
        ack_batch: int = 1024,
        promote_interval: float = 0.05,
        read_ahead: bool = True,
        read_ahead_hold: float = 1.0,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._configure(url, redis.Redis, locals())  # the options, by their names
        # Entries that cannot be Messages are dead-lettered through ``_bury`` (looked
        # up per use: a test may replace it).
        self._decoder = EntryDecoder(self.consumer, self.max_message_bytes,
                                     lambda message, record: self._bury(message, record),
                                     self.wire_bounds)
        #: The decoding of one entry (the tight loop of ``_messages`` falls back to it).
        self._message: Callable[..., Message | None] = self._decoder.message
        self._lock = threading.Lock()
        self._overflow: list[Message] = []
        self.read_ahead = read_ahead
        self.read_ahead_hold = read_ahead_hold
        #: Reads sent ahead, by (topics, group); None while one is being sent.
        self._aheads: dict[tuple[tuple[str, ...], str], Ahead | None] = {}
        self._last_read = float("-inf")  # monotonic time of the last read
        self._read_conns: list[Any] = []  # pool connections kept by reads
        self._closed = threading.Event()
        #: ``_closed.is_set()`` as a plain attribute (read per ack), set with it.
        self._closing = False
        self._retrying = reconnecting(
            CONNECTION_ERRORS, logger=log, what="redis call", attempts=5,
            backoff=reconnect_backoff(2.0), until=self._closed,
        )
        self.ack_flush_interval = ack_flush_interval
        self.ack_batch = max(1, ack_batch)
        self._acks: list[Receipt] = []
        self._ack_lock = threading.Lock()
        self._ack_full = threading.Event()  # wakes the flusher (full batch, close)
        self._flusher: threading.Thread | None = None
        self._flush_error: Exception | None = None
        self._fetches: set[Read] = set()
        self._fetches_done = threading.Condition(self._lock)

    # -- key names ------------------------------------------------------------------

    @staticmethod
    def retry_stream(topic: str, group: str) -> str:
        """The stream of ``group``'s redeliveries of ``topic``."""
        return wire.retry_stream(topic, group)

    @staticmethod
    def delayed_set(topic: str, group: str) -> str:
        """The sorted set of ``group``'s delayed retries of ``topic``."""
        return wire.delayed_set(topic, group)

    @staticmethod
    def dead_letter_stream(topic: str) -> str:
        """The dead-letter stream of ``topic``."""
        return wire.dead_letter_stream(topic)

    @staticmethod
    def message_id(topic: str, entry_id: str) -> str:
        """The id of the message at ``entry_id`` of stream ``topic``: entry ids are
        unique only within a stream, so the stream name is part of it."""
        return wire.message_id(topic, entry_id)

    # -- Broker protocol ------------------------------------------------------------

    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        """Add a message to stream ``topic``; its id is ``"<topic>/<entry id>"``."""
        fields = wire.entry(payload, codec.wire_headers(headers, key=key))
        entry_id = self._call(
            self._redis.xadd, topic, fields, maxlen=self.maxlen, approximate=True
        )
        return self.message_id(topic, codec.text(entry_id))

    def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Add ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key and
        headers) to stream ``topic`` in one MULTI/EXEC round trip; returns their ids in
        order, as :meth:`publish` would.

        All or nothing: Redis adds the whole batch in one transaction, or none of it
        when the transaction fails (:class:`~msgpatterns.errors.BrokerError`, nothing
        added). As with :meth:`publish`, a reply lost with a dropped connection is
        retried, which can add the batch twice (at least once, never partly)."""
        self._check_open()
        entries = [wire.entry(body_bytes(item.body),
                               codec.wire_headers(item.headers, key=item.key))
                   for item in outgoing(items)]
        if not entries:
            return []

        def send() -> Any:
            pipe = self._redis.pipeline(transaction=True)
            for fields in entries:
                pipe.xadd(topic, fields, maxlen=self.maxlen, approximate=True)
            return pipe.execute()

        return [self.message_id(topic, codec.text(e)) for e in self._call(send)]

    def subscribe(self, topic: str, group: str) -> None:
        """Create ``group`` on ``topic`` now (a fetch does it otherwise)."""
        self._check_open()
        self._ensure_groups([topic], group)

    def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                       timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries: stale ones claimed from dead consumers,
        due retries, then new entries (waiting up to ``timeout`` seconds).

        A :meth:`close` from another thread wakes a waiting fetch: it hands back what
        it read and raises :class:`~msgpatterns.errors.BrokerClosed`."""
        read = Read()
        with self._lock:
            self._check_open()
            self._fetches.add(read)
        try:
            out = self._fetch(topics, group, max_messages, timeout, read)
            with self._lock:
                closing = self._closed.is_set()
            if closing:  # close() ran meanwhile: nothing read now reaches a handler
                self._hand_back(out)
                raise BrokerClosed(f"{self!r} was closed during the fetch")
            return out
        finally:
            with self._lock:
                self._fetches.discard(read)
                self._fetches_done.notify_all()

    def _fetch(self, topics: Sequence[str], group: str, max_messages: int,
               timeout: float, read: Read) -> list[Message]:
        self._ensure_groups(topics, group)
        self._drop_unasked(topics, group)
        acks = self._take_acks()  # sent with the read below: one round trip for both
        try:
            out = self._take_overflow(topics, group, max_messages)
            wait = timeout
            now = time.monotonic()
            for topic in topics:
                slot = (topic, group)
                if now >= self._promote_at.get(slot, 0.0):
                    self._recovering(topics, group, self._promote, topic, group,
                                     max(max_messages, 100), now)
                due = self._next_due.get(slot)
                if due is not None:  # block no longer than until a known retry is due
                    wait = min(wait, max(0.0, due - now))
            if len(out) < max_messages:
                out.extend(self._recovering(topics, group, self._claim_stale, topics,
                                            group, max_messages - len(out)))
            remaining = max_messages - len(out)
            if remaining <= 0:
                if acks:
                    self._send_acks(acks)
                return out
            block = None if out or wait <= 0 else max(1, int(wait * 1000))
            got = self._recovering(topics, group, self._read, topics, group, remaining,
                                   block, read, acks)
        except BaseException:
            self._requeue_acks(acks)  # sent or not: an XACK sent twice is harmless
            raise
        out.extend(got[:remaining])
        if len(got) > remaining:
            with self._lock:
                self._overflow.extend(got[remaining:])
        return out

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds, to this group only, with ``attempt + 1``,
        the original payload and the message's headers as they are now."""
        self._check_open()
        self._redeliver(message, delay)

    def _redeliver(self, message: Message, delay: float, attempt: int | None = None) -> None:
        """Move the delivery to the retry path (the delayed set when ``delay`` > 0)."""
        r = receipt_of(message, Receipt, OWNER)
        fields = wire.entry(
            body_bytes(message.raw_body),
            codec.redelivery_headers(message, group=r.group, attempt=attempt),
        )
        retry = self.retry_stream(r.topic, r.group)
        if delay > 0:
            flat = [wire.to_bytes(x) for pair in fields.items() for x in pair]
            member = wire.pack([f"{r.stream}/{r.entry_id}".encode(), *flat])
            moved = self._move(r, self.delayed_set(r.topic, r.group), "zset",
                               [member], delay_ms=max(1, round(delay * 1000)))
            due = time.monotonic() + delay
            slot = (r.topic, r.group)
            self._next_due[slot] = min(self._next_due.get(slot, due), due)
            self._promote_at[slot] = min(self._promote_at.get(slot, due), due)
        else:
            moved = self._move(r, retry, "stream", fields)
        if not moved:
            log.debug("nack of %s ignored: claimed by another consumer", message.id)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Add the record to ``<topic>:dlq`` and remove the delivery, atomically."""
        self._check_open()
        self._bury(message, record)

    def _bury(self, message: Message, record: DeadLetter) -> None:
        r = receipt_of(message, Receipt, OWNER)
        fields = wire.entry(codec.dead_letter_body(record), codec.dead_letter_headers(record))
        moved = self._move(r, self.dead_letter_stream(r.topic), "stream", fields,
                           maxlen=self.dead_letter_maxlen)
        if not moved:
            log.debug("dead letter of %s ignored: claimed by another consumer", message.id)

    def close(self) -> None:
        """Stop, settle and release; idempotent.

        Guarantees, in order: no operation starts any more (each raises
        :class:`~msgpatterns.errors.BrokerClosed`); a fetch waiting in XREADGROUP is
        woken and hands back what it read; deliveries read but never returned by
        :meth:`fetch` are handed back (their attempt unchanged); queued acks are sent;
        then every delivery still pending under this consumer is handed back to its
        group's retry stream, where any consumer of the group reads it at once (its
        attempt unchanged: the delivery count Redis keeps): deliveries a consumer
        fetched and did not settle before ``close()`` - not run yet, or whose
        handler's settlement came after ``close()`` and was refused - never wait for
        ``visibility_timeout``; the connection pool is released if this broker
        created it. If handing back or
        sending acks fails, the pool is still released and the error is raised
        (:class:`~msgpatterns.errors.BrokerError`): those deliveries come back after
        ``visibility_timeout``, none is lost. Nothing reconnects afterwards.
        """
        with self._lock:
            if self._closed.is_set():
                return
            self._closing = True
            self._closed.set()
        self._ack_full.set()
        try:
            self._wake_fetches()
            with self._lock:
                unused, self._overflow = self._overflow, []
            try:
                try:
                    self._hand_back_ahead()
                finally:
                    self._hand_back(unused)
            finally:  # the acks go out even if a hand-back failed
                if self._flusher is not None:
                    self._flusher.join(timeout=5)
                try:
                    self._flush()
                    if self._flush_error is not None:  # the flusher's last batch failed
                        raise self._flush_error
                finally:
                    self._hand_back_pending()
        finally:
            while self._read_conns:
                self._redis.connection_pool.release(self._read_conns.pop())
            if self._owns_client:
                self._redis.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _wake_fetches(self, patience: float = 10.0) -> None:
        """Unblock fetches waiting in XREADGROUP (CLIENT UNBLOCK, so the reply is never
        lost on a killed socket) and wait until they have handed back what they read."""
        give_up = time.monotonic() + patience
        while True:
            with self._lock:
                ids = [f.client_id for f in self._fetches if f.client_id is not None]
                if not self._fetches:
                    return
            if time.monotonic() > give_up:
                log.error("%s: a fetch did not end within %gs of close()", self.consumer,
                          patience)
                return
            try:  # again each round: an unblock sent before the read blocked is a no-op
                for client_id in ids:
                    self._do(self._redis.client_unblock, client_id)
            except BrokerError:
                log.warning("%s: could not unblock a fetch", self.consumer, exc_info=True)
            with self._lock:
                if self._fetches:
                    self._fetches_done.wait(0.01)

    def _hand_back(self, messages: Sequence[Message]) -> None:
        """Return deliveries that no handler saw, their attempt unchanged."""
        for message in messages:
            self._redeliver(message, 0.0, attempt=message.attempt)

    def _hand_back_pending(self) -> None:
        """:meth:`close`: hand back every delivery still pending under this consumer in
        the groups it used (see :func:`own_pending`). Redis unreachable: logged, and
        those deliveries come back after ``visibility_timeout`` (none is lost)."""
        with self._lock:
            slots = sorted(self._origins.items())
        try:
            for (stream, group), (topic, retry) in slots:
                first = None
                while True:
                    entries = self._do(own_pending, self._redis, stream, group,
                                       self.consumer)
                    if not entries or entries[0][0] == first:  # none, or none could move
                        break
                    first = entries[0][0]
                    for entry_id, fields, deliveries in entries:
                        message = self._message(topic, stream, retry, group, entry_id,
                                                fields, deliveries)
                        if message is not None:
                            self._redeliver(message, 0.0, attempt=message.attempt)
        except BrokerError:
            log.warning("%s: could not hand back the deliveries pending under this "
                        "consumer on close(); they come back after visibility_timeout",
                        self.consumer, exc_info=True)

    # -- dead-letter admin ----------------------------------------------------------

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The admin of ``<topic>:dlq`` streams
        (:class:`~msgpatterns.brokers.redis.admin.RedisStreamsDeadLetters`), on this
        broker's client and retries."""
        return admin_for("msgpatterns.brokers.redis.admin:RedisStreamsDeadLetters",
                         self._redis, call=self._call)

    # -- steps a raw loop builds on (msgpatterns.brokers.redis.raw) ----------------------

    @property
    def client(self) -> Any:
        """The ``redis.Redis`` client this broker talks through."""
        return self._redis

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` - a call of this broker's client - with the adapter's
        reconnects (a lost connection is retried with backoff) and errors (redis-py's
        as the library's own); refused at once after :meth:`close`."""
        return self._call(fn, *args, **kwargs)

    def message_of(self, topic: str, stream: str, retry: bool, group: str,
                   entry_id: Any, fields: Any, deliveries: int) -> Message | None:
        """The Message of one entry of ``stream`` (``topic`` or its retry stream:
        ``retry``) read by ``group``, ``deliveries`` its delivery count; None when it
        cannot be one (it is dead-lettered with the reason, as a fetch does)."""
        return self._message(topic, stream, retry, group, entry_id, fields, deliveries)

    def claim_stale(self, topics: Sequence[str], group: str, limit: int) -> list[Message]:
        """Up to ``limit`` deliveries other consumers of ``group`` left unsettled longer
        than ``visibility_timeout``, claimed for this consumer (what a fetch does
        first; a lost group is re-created)."""
        return list(self._recovering(topics, group, self._claim_stale, topics, group,
                                     limit))

    def promote_due(self, topic: str, group: str, limit: int = 100) -> float | None:
        """Move up to ``limit`` due delayed retries of ``group`` into its retry stream
        (what a fetch does); returns when (``time.monotonic()``) the next delayed retry
        is due, None when none is waiting."""
        self._promote(topic, group, limit, time.monotonic())
        return self._next_due.get((topic, group))

    # -- internals --------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`_do`, refused at once after :meth:`close`."""
        self._check_open()
        return self._do(fn, *args, **kwargs)

    def _do(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried with backoff if the connection fails (never
        once closed); redis-py's exceptions come out as the library's own."""
        try:
            try:
                return self._attempt(fn, args, kwargs)
            except CONNECTION_ERRORS as exc:
                if self._closed.is_set():
                    raise BrokerClosed(f"{self!r} was closed during a redis call") from exc
                log.warning("redis call failed; retrying", exc_info=True)
                return self._retrying(self._attempt, fn, args, kwargs, retrying=True)
        except BrokerError:
            raise
        except redis.RedisError as exc:
            raise redis_error(exc, repr(self), self._closed.is_set()) from exc

    def _attempt(self, fn: Any, args: Any, kwargs: Any, retrying: bool = False) -> Any:
        if retrying and self._closed.is_set():  # a closed broker never reconnects
            raise BrokerClosed(f"{self!r} is closed")
        try:
            return fn(*args, **kwargs)
        except AUTH_ERRORS as exc:  # never retried as if transient
            raise redis_error(exc, repr(self)) from exc

    def _recovering(self, topics: Sequence[str], group: str, fn: Any, *args: Any,
                    **kwargs: Any) -> Any:
        """``fn(*args)``; if the group is gone (NOGROUP), re-create it and call again."""
        try:
            return fn(*args, **kwargs)
        except NoGroup:
            with self._lock:
                self._groups -= {g for g in self._groups if g[1] == group}
            self._ensure_groups(topics, group, lost=True)
            return fn(*args, **kwargs)

    def hand_back_unfetched(self, topics: Sequence[str], group: str) -> int:
        """Hand back at once what this broker read ahead of the fetches for ``topics``
        in ``group`` and no fetch has taken yet (a read's surplus, a read-ahead's
        reply): their streams go to another consumer now, which must see those entries
        before the later ones it reads itself. Returns how many were handed back.
        An ordered topic's feed calls it before it gives a partition up."""
        gone = set(topics)
        return self._hand_back_where(group, gone.__contains__)

    def _drop_unasked(self, topics: Sequence[str], group: str) -> None:
        """A fetch of ``group`` for ``topics``: hand back what was read ahead for other
        streams of the group (the set asked for changed: an ordered topic's partitions
        moved), so they are redelivered at once to whoever reads those streams now,
        before the later entries - never after ``read_ahead_hold`` or a visibility
        timeout. A read-ahead sent for another set of streams of the group is finished
        here: its entries of streams still asked for go first in line."""
        key = (tuple(topics), group)
        with self._lock:
            if not self._overflow and all(k == key or k[1] != group or a is None
                                          for k, a in self._aheads.items()):
                return  # the common case: nothing else read ahead
        asked = set(topics)
        self._hand_back_where(group, lambda topic: topic not in asked, keep=key)

    def _hand_back_where(self, group: str, gone: Callable[[str], bool], *,
                         keep: tuple[tuple[str, ...], str] | None = None) -> int:
        """Hand back the entries of ``group`` read ahead (the overflow, and the
        read-aheads but the one for ``keep``, finished here) whose topic is ``gone``;
        the finished read-aheads' other entries join the overflow after what it holds
        (read before them, and before anything read later). Handed back in the order
        read, so the stream's next reader sees them in that order."""
        with self._lock:
            taken = [a for k, a in self._aheads.items()
                     if k[1] == group and k != keep and a is not None]
            for ahead in taken:
                del self._aheads[ahead.key]
        later: list[Message] = []
        handed_later: list[Message] = []
        for ahead in taken:
            for m in self._messages(self._finish_ahead(ahead), ahead.origin, group):
                topic = receipt_of(m, Receipt, OWNER).topic
                (handed_later if gone(topic) else later).append(m)
        with self._lock:
            kept: list[Message] = []
            handed: list[Message] = []
            for m in self._overflow:
                r = receipt_of(m, Receipt, OWNER)
                (handed if r.group == group and gone(r.topic) else kept).append(m)
            self._overflow = kept + later
        handed += handed_later
        if handed:
            self._hand_back(handed)
        return len(handed)

    def _take_overflow(self, topics: Sequence[str], group: str, limit: int) -> list[Message]:
        with self._lock:
            if not self._overflow:
                return []
            taken: list[Message] = []
            kept: list[Message] = []
            for m in self._overflow:
                r = receipt_of(m, Receipt, OWNER)
                if len(taken) < limit and r.group == group and r.topic in topics:
                    taken.append(m)
                else:
                    kept.append(m)
            self._overflow = kept
            return taken

    def _move(self, r: Receipt, target: str, mode: str,
              fields: Mapping[str, Any] | list[bytes],
              *, delay_ms: int = 0, maxlen: int | None = None) -> bool:
        values = fields if isinstance(fields, list) else [
            x for pair in fields.items() for x in pair
        ]
        result = self._recovering([r.topic], r.group, self._do,
            self._settle_script,
            keys=[r.stream, target],
            args=[r.group, self.consumer, r.entry_id, "1" if r.retry else "0", mode,
                  delay_ms, "" if maxlen is None else maxlen, *values],
        )
        return bool(result)


    def __repr__(self) -> str:
        return f"RedisStreamsBroker(consumer={self.consumer!r})"
