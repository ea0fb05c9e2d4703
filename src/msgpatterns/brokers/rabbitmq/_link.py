"""What the pika parts of RabbitMQ (the sync adapter, the dead-letter admin, the raw
loop) share: pika's exceptions as the library's own, connection parameters from a URL,
a confirmed publish, properties as pika's type, and a channel whose publisher confirms
are counted as they arrive."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from msgpatterns._extras import require
from msgpatterns.brokers.rabbitmq._tls import pika_url
from msgpatterns.brokers.rabbitmq._wire import message_properties
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    UnroutableError,
    describe,
)

pika = require("pika", "rabbitmq")

__all__ = [
    "AUTH_ERRORS",
    "CONNECTION_ERRORS",
    "TRANSIENT",
    "Confirms",
    "basic_properties",
    "coalesce_output",
    "pika",
    "pika_errors",
    "publish_confirmed",
    "url_parameters",
]

#: Errors the reconnect loop treats as a lost connection (retried with backoff).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.ConnectionWrongStateError,
    ConnectionError,
)
#: Errors that mean an operation met a dying connection (worth one more try after the
#: reconnect). A refusal by the server (404, 406, returned, nacked) is not one of them.
TRANSIENT: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ChannelWrongStateError,
    ConnectionError,
)
#: Never retried: a wrong user, password or vhost permission does not heal by itself.
AUTH_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.ProbableAuthenticationError,
    pika.exceptions.AuthenticationError,
    pika.exceptions.ProbableAccessDeniedError,
)

def basic_properties(message_id: str | None, headers: Mapping[str, str]) -> Any:
    """:func:`~._wire.message_properties` as ``pika.BasicProperties``."""
    return pika.BasicProperties(**message_properties(message_id, headers))


def publish_confirmed(side: Any, exchange: str, routing_key: str, payload: bytes,
                      props: Any, *, who: str) -> None:
    """Publish (mandatory) on ``side``, a channel in confirm mode, and wait for the
    confirm; a message nothing would keep raises UnroutableError."""
    try:
        side.basic_publish(exchange, routing_key, payload, props, mandatory=True)
    except pika.exceptions.UnroutableError as exc:
        raise UnroutableError(
            f"{who}: no queue is bound to exchange {exchange!r} for routing key "
            f"{routing_key!r} (has a group subscribed?); nothing was sent"
        ) from exc
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            raise UnroutableError(
                f"{who}: exchange {exchange!r} does not exist (no group has "
                f"subscribed to it yet); nothing was sent"
            ) from exc
        raise


def coalesce_output(conn: Any) -> None:
    """Join the frames pika buffered for ``conn`` into one chunk, so that they leave in
    as few ``send`` calls as the socket takes (pika sends one frame per call: three per
    message). The bytes, their order and pika's byte count are unchanged; with a pika
    whose transport does not look as expected this does nothing."""
    transport = getattr(getattr(conn, "_impl", None), "_transport", None)
    buffers = getattr(transport, "_tx_buffers", None)
    if isinstance(buffers, deque) and len(buffers) > 1:
        joined = b"".join(buffers)
        buffers.clear()
        buffers.append(joined)


def url_parameters(url: Any, connect_timeout: float | None = None) -> Any:
    """pika connection parameters for an ``amqp://`` URL (``pika.ConnectionParameters``
    pass through); with ``connect_timeout``, a URL without timeouts gets it as its
    socket and stack timeouts (pika's defaults are 10 s and 15 s)."""
    if not isinstance(url, str):
        if not isinstance(url, pika.connection.Parameters):
            raise ConfigurationError(
                f"expected an amqp:// URL or pika.ConnectionParameters, got {url!r}")
        return url
    try:
        params = pika.URLParameters(pika_url(url))  # cafile= etc. as with aio-pika
    except ConfigurationError:
        raise
    except Exception as exc:
        raise ConfigurationError(f"not a usable AMQP URL: {describe(exc)}") from exc
    if connect_timeout is not None:
        query = url.partition("?")[2]
        if "socket_timeout" not in query:
            params.socket_timeout = connect_timeout
        if "stack_timeout" not in query:
            params.stack_timeout = connect_timeout
    return params


@contextmanager
def pika_errors(name: str, where: str, what: str,
                closed: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Translate pika's and the socket's exceptions into the library's own (the
    original is the cause); the library's own errors pass unchanged. ``name`` says
    who failed, ``where`` the server (never the credentials), ``closed`` whether a
    lost connection is the owner's own close."""
    try:
        yield
    except (BrokerError, ConfigurationError):
        raise
    except pika.exceptions.UnroutableError as exc:
        raise UnroutableError(f"{name}: {what}: RabbitMQ returned the message "
                              "(no queue bound); nothing was sent") from exc
    except pika.exceptions.NackError as exc:
        raise BrokerError(f"{name}: {what}: RabbitMQ refused the message "
                          "(publisher nack)") from exc
    except (pika.exceptions.AMQPConnectionError, ConnectionError) as exc:
        if closed():
            raise BrokerClosed(f"{name} is closed") from exc
        raise BrokerUnavailable(f"{name}: {what}: connection to {where} "
                                f"failed: {describe(exc) or type(exc).__name__}") from exc
    except pika.exceptions.AMQPError as exc:
        raise BrokerError(f"{name}: {what} failed: "
                          f"{describe(exc) or type(exc).__name__}") from exc


class Confirms:
    """A channel in confirm mode whose confirms are counted as they arrive instead of
    awaited one publish at a time (pika's BlockingChannel waits for each)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.seq = 0  # the last delivery tag published on the channel
        self.pending: dict[int, None] = {}  # tags awaiting a confirm, in order
        self.outcome: dict[int, bool] = {}  # tag -> acked (True) or nacked (False)
        self.returned: set[str] = set()  # message ids the server returned (unroutable)
        self.ready = False
        self.closed_by: BaseException | None = None  # why the server closed the channel

    def on_close(self, channel: Any, reason: BaseException) -> None:
        self.closed_by = reason

    def on_select_ok(self, frame: Any) -> None:
        self.ready = True

    def on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        if method.multiple:
            done = list(itertools.takewhile(lambda t: t <= method.delivery_tag,
                                            self.pending))
        else:
            done = [method.delivery_tag]
        for tag in done:
            if self.pending.pop(tag, "gone") is None:
                self.outcome[tag] = acked

    def on_return(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        if properties.message_id:
            self.returned.add(properties.message_id)
