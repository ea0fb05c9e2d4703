"""NatsJetStreamDeadLetters: the dead-letter admin of NATS JetStream.

Dead letters of every group are messages on the subject ``<topic>.__dlq`` of the
topic's stream, each carrying the full record. A replay publishes the message to
``<topic>.__retry.<group>`` (the group that dead-lettered it) or ``<topic>`` (every
group) and deletes the dead letter only after the stream confirmed the copy.

The admin works on a sync broker's connection and I/O thread: the broker's own
(:meth:`NatsJetStreamBroker.dead_letter_admin`), or one it opens on first use and closes
with :meth:`NatsJetStreamDeadLetters.close` (``NatsJetStreamDeadLetters(**settings)``,
the admin of the asyncio adapter: nothing connects inside the event loop).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from nats.js import api as js_api

from msgpatterns.brokers import codec
from msgpatterns.brokers.admin.base import ScannedDeadLetters
from msgpatterns.brokers.nats._session import nats
from msgpatterns.brokers.nats.broker import NatsJetStreamBroker
from msgpatterns.deadletter import DeadLetter, body_bytes

__all__ = ["NatsJetStreamDeadLetters"]


class NatsJetStreamDeadLetters(ScannedDeadLetters):
    """List, replay and purge the dead letters of NATS JetStream topics, on
    ``broker``'s connection and I/O thread."""

    def __init__(self, broker: NatsJetStreamBroker | None = None, /,
                 **settings: Any) -> None:
        """On ``broker``'s connection; or, without one, on a
        :class:`NatsJetStreamBroker` of its own built from ``settings`` (its keyword
        arguments) on first use and closed by :meth:`close`."""
        self._given = broker
        self._settings = settings
        self._own: NatsJetStreamBroker | None = None
        self._owning = threading.Lock()

    @property
    def _broker(self) -> NatsJetStreamBroker:
        if self._given is not None:
            return self._given
        with self._owning:
            if self._own is None:
                self._own = NatsJetStreamBroker(**self._settings)
            return self._own

    def close(self) -> None:
        """Close the broker this admin opened (none when it runs on a broker's own
        connection); idempotent."""
        with self._owning:
            own, self._own = self._own, None
        if own is not None:
            own.close()

    def knows(self, topic: str, group: str | None = None) -> bool:
        return self._broker.has_topic(topic)

    def _scan(self, topic: str) -> list[DeadLetter]:
        return self._broker.run(self._dead_letters(topic))

    def _replay(self, topic: str, record: DeadLetter, owner: str | None) -> None:
        b = self._broker
        subject = topic if owner is None else b.retry_subject(topic, owner)
        b.run(b.send(topic, subject, body_bytes(record.message.raw_body),
                     codec.replay_headers(record, group=owner)))
        b.run(self._delete(topic, int(record.extra["dlq_seq"])))

    def _remove(self, topic: str, records: Sequence[DeadLetter]) -> None:
        for record in records:
            self._broker.run(self._delete(topic, int(record.extra["dlq_seq"])))

    async def _dead_letters(self, topic: str) -> list[DeadLetter]:
        b = self._broker
        stream = await b.existing_stream(topic)
        if stream is None:  # an admin read never creates a stream
            return []
        sub = await b.jetstream.pull_subscribe(
            b.dead_letter_subject(topic), stream=stream,
            config=js_api.ConsumerConfig(
                ack_policy=js_api.AckPolicy.NONE, deliver_policy=js_api.DeliverPolicy.ALL,
                inactive_threshold=30.0,
            ),
        )
        records: list[DeadLetter] = []
        try:
            while True:
                try:
                    msgs = await sub.fetch(256, timeout=0.2)
                except (TimeoutError, nats.errors.TimeoutError):
                    break
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    records.append(codec.read_dead_letter(
                        msg.data, msg.headers or {}, fallback_id=f"{stream}:{seq}",
                        fallback_topic=topic, location={"dlq_seq": str(seq)},
                    ))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
            with contextlib.suppress(nats.errors.Error):
                await b.jetstream.delete_consumer(stream, sub._consumer)
        return records

    async def _delete(self, topic: str, seq: int) -> None:
        await self._broker.jetstream.delete_msg(self._broker.stream_name(topic), seq)

    def __repr__(self) -> str:
        shown = self._given if self._given is not None else self._own
        return f"NatsJetStreamDeadLetters({shown!r})"
