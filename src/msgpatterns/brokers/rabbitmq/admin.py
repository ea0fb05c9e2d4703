"""RabbitMQDeadLetters: the dead-letter admin of RabbitMQ.

Each consumer group has its own dead-letter queue, ``<group queue>.dlq`` (a classic
queue). The admin reads it with ``basic_get`` on a short-lived connection of its own
(never the adapter's I/O thread): a record is acked off the queue only after its
replay was confirmed, or when it is purged; everything else goes back to the queue
when the scan ends.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from msgpatterns.brokers import codec
from msgpatterns.brokers.admin.base import selected
from msgpatterns.brokers.rabbitmq._link import basic_properties, pika, pika_errors, url_parameters
from msgpatterns.brokers.rabbitmq._wire import dead_letter_queue_name
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.errors import BrokerUnavailable, ConfigurationError, describe

__all__ = ["RabbitMQDeadLetters"]

_Scan = Iterator[tuple[tuple[Any, int], DeadLetter]]


class RabbitMQDeadLetters:
    """List, replay and purge the dead letters of RabbitMQ consumer groups.

    Args:
        url: an ``amqp://`` URL or ``pika.ConnectionParameters``.
        exchange: the adapter's exchange name template (``{topic}``).
        queue: the adapter's group queue name template (``{topic}``, ``{group}``).
        check: called before each operation (the adapter passes its closed-state
            check, so the admin of a closed broker refuses at once).

    Every operation needs a ``group``: RabbitMQ keeps dead letters per group queue.
    """

    def __init__(self, url: Any, *, exchange: str = "{topic}", queue: str = "{topic}.{group}",
                 check: Callable[[], None] | None = None) -> None:
        self._params = url_parameters(url)
        self.exchange_template = exchange
        self.queue_template = queue
        self._check = check or (lambda: None)

    def _errors(self, what: str) -> AbstractContextManager[None]:
        return pika_errors("dead-letter admin", self._where(), what)

    def _where(self) -> str:
        p = self._params
        return f"{p.host}:{p.port} (vhost {p.virtual_host!r})"

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        """Dead letters of ``group`` (required: each group has its own queue)."""
        self._check()
        out: list[DeadLetter] = []
        with self._errors("list_dead_letters"), \
                self._scan(topic, _require_group(group)) as scan:
            for _, record in scan:
                if limit is not None and len(out) >= limit:
                    break
                out.append(record)
        return out

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        """Publish dead letters back (to the group's queue, or the topic's exchange)
        with attempts reset; each is acked off the dead-letter queue only after its
        publish was confirmed."""
        self._check()
        group = _require_group(group)
        count = 0
        with self._errors("replay_dead_letters"), self._scan(topic, group) as scan:
            for (channel, tag), record in scan:
                if not selected(record, None, ids):
                    continue
                props = basic_properties(
                    record.id, codec.replay_headers(record, with_id=False))
                payload = body_bytes(record.message.raw_body)
                if to_topic:
                    channel.basic_publish(self.exchange_template.format(topic=topic), topic,
                                          payload, props, mandatory=True)
                else:
                    channel.basic_publish("", self._queue(topic, group), payload, props,
                                          mandatory=True)
                channel.basic_ack(tag)
                count += 1
        return count

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        self._check()
        group = _require_group(group)
        count = 0
        with self._errors("purge_dead_letters"), self._scan(topic, group) as scan:
            for (channel, tag), record in scan:
                if selected(record, None, ids):
                    channel.basic_ack(tag)
                    count += 1
        return count

    def knows(self, topic: str, group: str | None = None) -> bool:
        """True when ``group``'s queue or its dead-letter queue exists."""
        self._check()
        queue = self._queue(topic, group or "")
        with self._errors("knows"):
            conn = self._connect()
            try:
                for name in (queue, dead_letter_queue_name(queue)):
                    channel = conn.channel()
                    try:
                        channel.queue_declare(name, passive=True)
                        return True
                    except pika.exceptions.ChannelClosedByBroker as exc:
                        if exc.reply_code != 404:
                            raise
                return False
            finally:
                conn.close()

    def close(self) -> None:
        """Nothing to release: every operation closes its own connection."""

    def __enter__(self) -> RabbitMQDeadLetters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> Any:
        """A short-lived connection; any failure to open it is
        :class:`~msgpatterns.errors.BrokerUnavailable` (pika raises several kinds)."""
        try:
            return pika.BlockingConnection(self._params)
        except Exception as exc:
            raise BrokerUnavailable(f"cannot connect to RabbitMQ at {self._where()}: "
                                    f"{describe(exc) or type(exc).__name__}") from exc

    def _queue(self, topic: str, group: str) -> str:
        return self.queue_template.format(topic=topic, group=group)

    @contextmanager
    def _scan(self, topic: str, group: str) -> Iterator[_Scan]:
        """Every message of the group's dead-letter queue, fetched unacked; whatever is
        not acked is returned to the queue when the scan ends."""
        conn = self._connect()
        try:
            channel = conn.channel()
            channel.confirm_delivery()
            dlq = dead_letter_queue_name(self._queue(topic, group))
            try:
                depth = channel.queue_declare(dlq, passive=True).method.message_count
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                depth = 0  # no dead letter yet: the queue does not exist

            def scan() -> _Scan:
                for _ in range(depth):
                    method, props, body = channel.basic_get(dlq, auto_ack=False)
                    if method is None:
                        return
                    record = codec.read_dead_letter(
                        body, props.headers or {}, fallback_id=props.message_id or "",
                        fallback_topic=topic,
                        location={"dlq": dlq, "delivery_tag": str(method.delivery_tag)},
                    )
                    yield (channel, method.delivery_tag), record

            yield scan()
        finally:
            conn.close()

    def __repr__(self) -> str:
        return f"RabbitMQDeadLetters({self._where()!r})"


def _require_group(group: str | None) -> str:
    if not group:
        raise ConfigurationError("RabbitMQ keeps dead letters per group queue: pass a group")
    return group
