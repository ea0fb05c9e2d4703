"""The side channels of :class:`~msgpatterns.brokers.rabbitmq.broker.RabbitMQBroker`
(run on its I/O thread): publishes with publisher confirms and declarations go on a
*side* channel, reopened on next use when the server closed it (a refused publish or
declaration never costs the consume channel); ``publish_many`` on a channel whose
confirms are counted as they arrive. A part of the adapter: its state is the
adapter's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns.brokers.rabbitmq._link import (
    Confirms,
    coalesce_output,
    pika,
    publish_confirmed,
)
from msgpatterns.brokers.rabbitmq._wire import (
    dead_letter_queue_arguments,
    retry_queue_arguments,
)
from msgpatterns.errors import BrokerError, UnroutableError

__all__ = ["SideChannels"]


class SideChannels:
    """Confirmed publishes and declarations (see the module docstring)."""

    name: str
    declare: bool
    queue_type: str | None
    _conn: Any
    _side: Any
    _batches: Confirms | None
    _close_timeout: float
    _declared: set[str]

    if TYPE_CHECKING:  # the adapter's own, elsewhere
        def exchange_name(self, topic: str) -> str: ...
        def queue_name(self, topic: str, group: str) -> str: ...
        @staticmethod
        def retry_queue_name(queue: str, delay_ms: int) -> str: ...
        @staticmethod
        def dead_letter_queue_name(queue: str) -> str: ...

    def _side_channel(self) -> Any:
        """The channel for publishes and declarations, (re)opened on demand: the server
        closes it on a refused publish or declaration, never the consume channel."""
        side = self._side
        if side is None or not side.is_open:
            if self._conn is None:
                raise pika.exceptions.ConnectionWrongStateError("not connected")
            side = self._conn.channel()
            side.confirm_delivery()
            self._side = side
        return side


    def _publish_confirmed(self, exchange: str, routing_key: str, payload: bytes,
                           props: Any) -> None:
        """Publish (mandatory) on the side channel and wait for the confirm; a message
        nothing would keep raises UnroutableError."""
        publish_confirmed(self._side_channel(), exchange, routing_key, payload, props,
                          who=self.name)


    def _confirm_channel(self) -> Confirms:
        """The publish_many channel, (re)opened in confirm mode with counted confirms."""
        batches = self._batches
        if batches is not None and batches.channel.is_open:
            return batches
        if self._conn is None:
            raise pika.exceptions.ConnectionWrongStateError("not connected")
        batches = Confirms(self._conn.channel())
        impl = batches.channel._impl
        impl.confirm_delivery(ack_nack_callback=batches.on_confirm,
                              callback=batches.on_select_ok)
        impl.add_on_return_callback(batches.on_return)
        impl.add_on_close_callback(batches.on_close)
        give_up = time.monotonic() + self._close_timeout
        while not batches.ready and time.monotonic() < give_up:
            self._conn.process_data_events(time_limit=0.002)
        if not batches.ready:
            raise pika.exceptions.AMQPChannelError("confirm mode was not acknowledged")
        self._batches = batches
        return batches


    def _publish_batch(self, exchange: str, routing_key: str,
                       batch: Sequence[tuple[str, bytes, Any]]
                       ) -> tuple[list[bool], BaseException | None]:
        """Publish every message (mandatory), then serve the connection until each is
        confirmed or ``close_timeout`` passes: which were acked (and not returned), and
        the failure that stopped the batch, if any."""
        confirms = self._confirm_channel()
        tags: list[int] = []
        failure: BaseException | None = None
        impl = confirms.channel._impl  # buffered writes: no flush per message
        try:
            for _, payload, props in batch:
                # counted before the publish: its confirm can arrive while pika flushes
                confirms.seq += 1
                confirms.pending[confirms.seq] = None
                tags.append(confirms.seq)
                impl.basic_publish(exchange, routing_key, payload, props, mandatory=True)
            coalesce_output(self._conn)
            give_up = time.monotonic() + self._close_timeout
            while (confirms.pending and confirms.channel.is_open
                   and time.monotonic() < give_up):
                assert self._conn is not None
                self._conn.process_data_events(time_limit=0.002)
        except pika.exceptions.AMQPChannelError as exc:  # closed by the server meanwhile
            failure = confirms.closed_by or exc
        if failure is None and confirms.pending and not confirms.channel.is_open:
            failure = confirms.closed_by or BrokerError(
                f"{self.name}: the publish channel closed before every message was "
                "confirmed")
        if isinstance(failure, pika.exceptions.ChannelClosedByBroker) \
                and failure.reply_code == 404:
            failure = UnroutableError(f"{self.name}: exchange {exchange!r} does not exist "
                                      "(no group has subscribed to it yet)")
        ok = [confirms.outcome.pop(tag, False) and mid not in confirms.returned
              for tag, (mid, _, _) in zip(tags, batch, strict=False)]
        ok += [False] * (len(batch) - len(ok))
        confirms.returned.clear()
        for tag in tags:
            confirms.pending.pop(tag, None)
        if failure is not None:
            self._batches = None
        return ok, failure


    def _declare_group(self, topic: str, group: str) -> None:
        exchange = self._declare_exchange(self.exchange_name(topic))
        queue = self._declare_queue(self.queue_name(topic, group))
        if self.declare and f"bind:{queue}" not in self._declared:
            self._side_channel().queue_bind(queue, exchange, routing_key=topic)
            self._declared.add(f"bind:{queue}")


    def _declare_exchange(self, exchange: str) -> str:
        if self.declare and f"exchange:{exchange}" not in self._declared:
            self._side_channel().exchange_declare(exchange, exchange_type="fanout",
                                                  durable=True)
            self._declared.add(f"exchange:{exchange}")
        return exchange


    def _queue_arguments(self) -> dict[str, Any]:
        return {} if self.queue_type is None else {"x-queue-type": self.queue_type}


    def _declare_queue(self, queue: str) -> str:
        if self.declare and f"queue:{queue}" not in self._declared:
            self._side_channel().queue_declare(queue, durable=True,
                                               arguments=self._queue_arguments())
            self._declared.add(f"queue:{queue}")
        return queue


    def _declare_dead_letter_queue(self, queue: str) -> str:
        """A classic queue: dead letters are inspected by fetching and returning them,
        which a quorum queue's delivery limit would eventually punish."""
        name = self.dead_letter_queue_name(queue)
        if self.declare and f"queue:{name}" not in self._declared:
            self._side_channel().queue_declare(
                name, durable=True, arguments=dead_letter_queue_arguments(self.queue_type))
            self._declared.add(f"queue:{name}")
        return name


    def _declare_retry_queue(self, queue: str, delay_ms: int) -> str:
        """Declared on every use: ``x-expires`` deletes a retry queue a minute after its
        last use, always after its last message has moved on."""
        name = self.retry_queue_name(queue, delay_ms)
        self._side_channel().queue_declare(
            name, durable=True,
            arguments=retry_queue_arguments(queue, delay_ms, self.queue_type))
        return name
