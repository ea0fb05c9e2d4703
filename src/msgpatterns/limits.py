"""Resource bounds on what a producer can make a consumer hold: ``max_message_bytes``.

A hostile or broken producer can publish a message of any size its broker accepts (two
50 MB bodies grew a consumer's resident memory by 286 MB). Every adapter takes
``max_message_bytes`` (default :data:`DEFAULT_MAX_MESSAGE_BYTES`, ``None``: no bound):
a delivery whose body plus headers is larger is never handed to the handler; it is
dead-lettered at once with a reason that names its size and the bound (a
:class:`MessageTooLarge`, a :class:`~msgpatterns.errors.MalformedMessage`), its raw
body kept, like any message the adapter cannot hand out, and the consumer goes on.

Adapters call :func:`oversize_reason` (a reason string, for sans-I/O cores that return
a verdict) or :func:`check_message_size` (raises, for decoders that raise
``MalformedMessage``) on the raw delivery, before anything is decoded. Both cost
``len()`` calls: no copy, no decoding.

The check runs on a delivery the client library has already read into memory: it
bounds what the *consumer* does with it (decoding, handler, retries, batching), not the
read itself. To bound that too, set the broker's own limit - Redis
``proto-max-bulk-len``, RabbitMQ ``max_message_size``, Kafka ``message.max.bytes`` on
the broker and ``fetch.max.bytes``/``max.partition.fetch.bytes`` on the consumer, NATS
``max_payload`` (docs/security.md, "Resource bounds").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgpatterns.errors import ConfigurationError, MessageTooLarge

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MessageTooLarge",
    "check_max_message_bytes",
    "check_message_size",
    "message_size",
    "oversize_reason",
]

#: The default bound on a delivery's body plus headers, in bytes (16 MiB: RabbitMQ
#: 4's default ``max_message_size``, 16x Kafka's and NATS' default message limit).
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

Headers = Mapping[str, object] | Iterable[tuple[str, object]] | None


def check_max_message_bytes(value: object) -> int | None:
    """``value`` as a ``max_message_bytes`` option (an int >= 1, or None for no
    bound), else a :class:`~msgpatterns.errors.ConfigurationError`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"max_message_bytes must be an int >= 1 (bytes of body plus headers) or None "
            f"for no bound, got {value!r}")
    return value


def _length(value: object) -> int:
    """Bytes of one body or header part: exact for bytes, at least one per character
    of text (exact for ASCII), the text of anything else (an AMQP table value)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if value is None:
        return 0
    return len(str(value))


def message_size(body: object, headers: Headers = None, key: object = None) -> int:
    """The bytes a delivery holds: its body, each header's name and value, its key.

    ``headers`` is a mapping or ``(name, value)`` pairs (Kafka's list); values may be
    bytes, text or anything else (counted as their text).
    """
    size = _length(body) + _length(key)
    if headers:
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        for name, value in pairs:
            size += _length(name) + _length(value)
    return size


def oversize_reason(body: object, headers: Headers = None, key: object = None, *,
                    limit: int | None) -> str | None:
    """Why the delivery is over ``limit`` (``max_message_bytes``), or None when it is
    within it (or ``limit`` is None). The body alone is measured first, so an
    oversized body is refused without walking its headers."""
    if limit is None:
        return None
    body_bytes = _length(body)
    if body_bytes <= limit:
        total = message_size(body, headers, key)
        if total <= limit:
            return None
        return (f"the message is {total} bytes (body {body_bytes}, headers and key "
                f"{total - body_bytes}), over max_message_bytes={limit}")
    return f"the message body is {body_bytes} bytes, over max_message_bytes={limit}"


def check_message_size(body: object, headers: Headers = None, key: object = None, *,
                       limit: int | None) -> None:
    """Raise :class:`MessageTooLarge` (a ``MalformedMessage``: the adapter dead-letters
    the delivery with the reason) when the delivery is over ``limit``."""
    reason = oversize_reason(body, headers, key, limit=limit)
    if reason is not None:
        raise MessageTooLarge(reason)
