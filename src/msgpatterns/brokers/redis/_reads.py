"""The read side of :class:`~msgpatterns.brokers.redis.broker.RedisStreamsBroker`:
XREADGROUP on a pool connection the adapter keeps (the queued acks in the same write),
the reads of a consumer's own pending entries after a lost reply, the read-ahead under a
backlog, and the tight loop that turns a raw reply into Messages."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from msgpatterns import _redispy as redispy
from msgpatterns.brokers import codec
from msgpatterns.brokers.redis._link import CONNECTION_ERRORS, redis
from msgpatterns.brokers.redis._wire import (
    EntryDecoder,
    Receipt,
    ack_commands,
    mark_lost,
    note_seen,
    reread_done,
)
from msgpatterns.message import Message, delivered

__all__ = ["Ahead", "Read", "StreamReads"]

log = logging.getLogger("msgpatterns.brokers.redis")


@dataclass(eq=False, slots=True)
class Read:
    """A fetch in progress: the Redis client id of the connection it blocks on."""

    client_id: int | None = None


@dataclass(eq=False, slots=True)
class Ahead:
    """An XREADGROUP sent ahead of the fetch that takes it: its connection, with the
    replies of ``acks`` ack commands and then the read's reply still to come.
    ``acked``: the deliveries those commands ack (queued again if the replies never
    come: the acks may not have reached Redis)."""

    conn: Any
    key: tuple[tuple[str, ...], str]
    origin: dict[str, tuple[str, bool]]
    acks: int
    since: float
    acked: list[Receipt]


class StreamReads:
    """XREADGROUP, read-ahead and reply decoding (a part of the sync adapter: its
    state is the adapter's)."""

    consumer: str
    read_ahead: bool
    read_ahead_hold: float
    ack_flush_interval: float
    max_message_bytes: int | None
    _redis: Any
    _lock: threading.Lock
    _ack_lock: threading.Lock
    _closed: threading.Event
    _flusher: threading.Thread | None
    _aheads: dict[tuple[tuple[str, ...], str], Ahead | None]
    _last_read: float
    _read_conns: list[Any]
    _seen: dict[tuple[str, str], str]
    _reread: dict[tuple[str, str], str]
    _decoder: EntryDecoder

    if TYPE_CHECKING:  # the adapter's own, elsewhere
        def retry_stream(self, topic: str, group: str) -> str: ...
        def _do(self, fn: Any, *args: Any, **kwargs: Any) -> Any: ...
        def _send_acks(self, batch: Sequence[Receipt]) -> None: ...
        def _requeue_acks(self, batch: list[Receipt]) -> None: ...
        def _wake_flusher(self) -> None: ...
        def _hand_back(self, messages: Sequence[Message]) -> None: ...

    def _read(self, topics: Sequence[str], group: str, count: int,
              block: int | None, read: Read,
              acks: Sequence[Receipt] = ()) -> list[Message]:
        """XREADGROUP of new entries; the queued ``acks`` go in the same write (one
        round trip for both).

        Read-ahead: when a read fills ``count`` (a backlog) less than a quarter of
        ``read_ahead_hold`` after the previous read (a consumer keeping up), the next
        XREADGROUP (without BLOCK) is written at once, with the acks queued by then,
        and its reply left for the next fetch, so Redis prepares the next batch while
        the handlers run. Those entries are this consumer's pending deliveries like any
        others: the next fetch takes them, :meth:`close` hands back what no fetch
        took, and so does the flusher thread when no fetch took them within
        ``read_ahead_hold`` seconds (a consumer stopped without closing its
        broker). Once entries are read, nothing here raises: a failure to send the
        acks puts them back in the queue."""
        streams: dict[str, str] = {}
        origin: dict[str, tuple[str, bool]] = {}
        for topic in topics:
            retry_key = self.retry_stream(topic, group)
            streams[retry_key] = ">"
            streams[topic] = ">"
            origin[retry_key] = (topic, True)
            origin[topic] = (topic, False)
        head: list[Any] = ["XREADGROUP", "GROUP", group, self.consumer, "COUNT", count]
        tail = ["STREAMS", *streams, *streams.values()]
        key = (tuple(topics), group)
        got: list[Message] = []
        ahead = self._take_ahead(key)
        if ahead is not None:
            got = self._messages(self._finish_ahead(ahead), ahead.origin, group)
        if not got:
            reply, deleted = self._do(self._read_own_first, head, streams, group, block,
                                      read, ack_commands(acks) if acks else ())
            acks = ()
            if deleted:
                self._ack_deleted(deleted, origin, group)
            got = self._messages(reply, origin, group)
        now = time.monotonic()
        steady, self._last_read = now - self._last_read < self.read_ahead_hold / 4, now
        if (steady and len(got) >= count and self.read_ahead
                and self.ack_flush_interval > 0 and not self._reread
                and self._send_ahead(key, origin, acks, head + tail)):
            return got
        if acks:
            try:
                self._send_acks(acks)
            except Exception:  # the entries are read: hand them out, ack later
                log.warning("%s: sending acks failed; queued again", self.consumer,
                            exc_info=True)
                self._requeue_acks(list(acks))
        return got

    def _read_own_first(self, head: list[Any], streams: Mapping[str, str], group: str,
                        block: int | None, read: Read,
                        acks: Sequence[tuple[Any, ...]]) -> tuple[Any, list[tuple[str, str]]]:
        """One XREADGROUP: of this consumer's own pending entries from where a lost
        reply left them (see :func:`~._wire.mark_lost`), for the streams that have some,
        and of new entries for the others; BLOCK only when it reads new entries alone. A
        reply lost on the wire marks its streams to be read again (the retry of this
        call does that). Returns the raw reply and the entries deleted while pending."""
        reread = self._reread
        ids = {stream: reread.get((stream, group), ">") for stream in streams}
        again = any(start != ">" for start in ids.values())
        args = [*head, *(["BLOCK", block] if block is not None and not again else ()),
                "STREAMS", *ids, *ids.values()]
        try:
            reply = self._read_on_own_connection(args, read, acks)
        except CONNECTION_ERRORS:
            mark_lost(self._seen, reread, ids, group)
            raise
        return reply, reread_done(reply, reread, ids, group) if again else []

    def _ack_deleted(self, deleted: Sequence[tuple[str, str]],
                     origin: Mapping[str, tuple[str, bool]], group: str) -> None:
        """Ack own pending entries that were deleted (trimmed) meanwhile: nothing can
        deliver them any more."""
        log.error("%s: %d pending entries were trimmed before being processed: %s",
                  group, len(deleted), deleted[:10])
        self._send_acks([Receipt(stream, eid, group, *origin[stream])
                         for stream, eid in deleted])

    def _take_ahead(self, key: tuple[tuple[str, ...], str]) -> Ahead | None:
        """The read sent ahead for ``key``, now the caller's (None if there is none,
        or it is still being sent)."""
        with self._lock:
            ahead = self._aheads.get(key)
            if ahead is None:
                return None
            del self._aheads[key]
            return ahead

    def _send_ahead(self, key: tuple[tuple[str, ...], str],
                    origin: dict[str, tuple[str, bool]], acks: Sequence[Receipt],
                    read: list[Any]) -> bool:
        """Write the ``acks`` and then ``read`` on a connection kept until a fetch
        (or :meth:`close`, or the flusher) reads their replies. False, and nothing
        sent, when ``key`` has a read-ahead already (several consumers sharing this
        broker) or the write failed."""
        with self._lock:
            if self._closed.is_set() or key in self._aheads:
                return False
            self._aheads[key] = None  # reserved
        conn = self._take_conn()
        commands = [*(ack_commands(acks) if acks else ()), read]
        try:
            redispy.send_commands(conn, commands)
        except Exception:
            self._give_conn(conn, broken=True)
            with self._lock:
                self._aheads.pop(key, None)
            # the read may have reached Redis: what it read is to be read again
            mark_lost(self._seen, self._reread, dict.fromkeys(origin, ">"), key[1])
            log.warning("%s: read-ahead failed", self.consumer, exc_info=True)
            return False
        with self._lock:
            self._aheads[key] = Ahead(conn, key, origin, len(commands) - 1,
                                      time.monotonic(), list(acks))
        if self._flusher is None:  # it hands back a read-ahead no fetch takes
            with self._ack_lock:
                self._wake_flusher()
        return True

    def _finish_ahead(self, ahead: Ahead) -> Any:
        """The reply of a read sent ahead (None if it failed: its entries come back
        after ``visibility_timeout``, at least once)."""
        conn = ahead.conn
        try:
            refused: BaseException | None = None
            for _ in range(ahead.acks):
                try:
                    redispy.read_reply(conn)
                except redis.ResponseError as exc:
                    refused = exc
            if refused is not None:
                log.error("%s: redis refused acks (%s); those messages will be "
                          "redelivered", self.consumer, refused)
            reply = redispy.read_reply(conn)
        except Exception:
            self._give_conn(conn, broken=True)
            self._requeue_acks(ahead.acked)  # sent or not: an XACK sent twice is harmless
            # what it read is pending under this consumer: the next read reads it again
            mark_lost(self._seen, self._reread, dict.fromkeys(ahead.origin, ">"),
                      ahead.key[1])
            log.warning("%s: reading a read-ahead failed; its acks are queued again and "
                        "its entries are read again by the next fetch", self.consumer,
                        exc_info=True)
            return None
        self._give_conn(conn)
        return reply

    def _hand_back_ahead(self, older_than: float | None = None) -> None:
        """Read the read-aheads no fetch took (at all, or within ``older_than``
        seconds) and hand their deliveries back."""
        now = time.monotonic()
        with self._lock:
            stale = [a for a in self._aheads.values() if a is not None and
                     (older_than is None or now - a.since >= older_than)]
            for ahead in stale:
                del self._aheads[ahead.key]
        for ahead in stale:
            self._hand_back(self._messages(self._finish_ahead(ahead), ahead.origin,
                                           ahead.key[1]))

    def _take_conn(self) -> Any:
        """A connection for a read: one an earlier read kept, or a pool connection
        (reads keep theirs: no pool round per fetch)."""
        try:
            return self._read_conns.pop()
        except IndexError:
            pass
        return redispy.pool_connection(self._redis)

    def _give_conn(self, conn: Any, broken: bool = False) -> None:
        """Keep ``conn`` for the next read, or give it back to the pool (``broken``:
        disconnected first, a reply may still be on the way; or closed)."""
        if broken:
            redispy.drop(conn)
        if broken or self._closed.is_set():
            redispy.release(self._redis, conn)
        else:
            self._read_conns.append(conn)

    def _messages(self, reply: Any, origin: Mapping[str, tuple[str, bool]],
                  group: str) -> list[Message]:
        """The deliveries in an XREADGROUP reply as redis-py's connection hands it back
        before any response callback (RESP2: ``[[stream, entries]...]``, RESP3:
        ``{stream: entries}``; an entry is ``[id, [name, value, ...]]``, or
        ``[id, None]`` when it was deleted while pending).

        One tight loop: an entry of a single ``body`` field (what :meth:`publish`
        writes without headers) becomes a Message here at once; any other entry goes
        through the decoder (headers, foreign producers, malformed entries, which are
        dead-lettered on their own while the rest are delivered)."""
        out: list[Message] = []
        if not reply:
            return out
        append = out.append
        slow = self._decoder.message
        receipt = Receipt
        new_receipt = tuple.__new__
        make = delivered
        # Entries added in the same millisecond share its timestamp: ``ms`` is that
        # millisecond's id prefix (b"<ms>-"), tested without building anything.
        ms, timestamp = b"-", 0.0
        seen = self._seen
        # Bodies above this go through ``slow`` (which dead-letters them): one
        # comparison per entry, no bound is sys.maxsize.
        most = self.max_message_bytes or sys.maxsize
        for stream_name, entries in reply.items() if isinstance(reply, dict) else reply:
            stream = stream_name if type(stream_name) is str else codec.text(stream_name)
            topic, retry = origin[stream]
            prefix = topic + "/"
            if entries:  # the highest id read (a lost reply is read again above it)
                note_seen(seen, stream, group, entries[-1][0])
            # Taken off the reply one by one, so each entry's lists are freed as soon
            # as its Message exists: fewer live objects for the garbage collector to
            # scan and promote while the batch is built.
            entries.reverse()
            pop = entries.pop
            while entries:
                entry_id, fields = pop()
                if fields is None:  # deleted (trimmed) while pending
                    continue
                if (type(entry_id) is bytes and type(fields) is list and len(fields) == 2
                        and fields[0] == b"body" and type(fields[1]) is bytes
                        and len(fields[1]) <= most):
                    if not entry_id.startswith(ms):
                        head = entry_id.partition(b"-")[0]
                        ms, timestamp = head + b"-", int(head) / 1000
                    eid = entry_id.decode("ascii")
                    append(make(fields[1], prefix + eid, topic, timestamp,
                                new_receipt(receipt, (stream, eid, group, topic, retry))))
                    continue
                message = slow(topic, stream, retry, group, entry_id, fields, 1)
                if message is not None:
                    append(message)
        return out

    def _read_on_own_connection(self, args: list[Any], read: Read,
                                acks: Sequence[tuple[Any, ...]] = ()) -> Any:
        """``acks`` then XREADGROUP on a pool connection whose client id :meth:`close`
        knows, so it can wake it with CLIENT UNBLOCK (the reply, entries or none,
        always arrives). The acks and CLIENT ID go in the same write as the read: one
        round trip. The XREADGROUP reply is returned raw (no response callback).

        An ack Redis refuses is logged (that delivery is redelivered after
        ``visibility_timeout``: at least once) and does not fail the read."""
        conn = self._take_conn()
        refused: BaseException | None = None
        try:
            redispy.send_commands(conn, [*acks, ("CLIENT", "ID"), args])
            for _ in acks:
                try:
                    redispy.read_reply(conn)
                except redis.ResponseError as exc:
                    refused = exc
            read.client_id = int(redispy.read_reply(conn))
            reply = redispy.read_reply(conn)
        except BaseException:
            read.client_id = None
            self._give_conn(conn, broken=True)  # a reply may still be on the way
            raise
        read.client_id = None
        self._give_conn(conn)
        if refused is not None:
            log.error("%s: redis refused acks (%s); those messages will be redelivered",
                      self.consumer, refused)
        return reply
