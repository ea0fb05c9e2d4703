"""``@idempotent``: a handler that runs at most once per key, whatever calls it.

It wraps any callable - a :class:`~msgpatterns.Consumer` handler taking a
:class:`~msgpatterns.Message`, a raw pika callback ``(channel, method, properties,
body)``, a confluent-kafka poll loop's ``handle(msg)`` - because the key is computed
by a callable that receives exactly the handler's arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from msgpatterns.errors import ConfigurationError, MalformedMessage
from msgpatterns.idempotency.fingerprint import fingerprint_of
from msgpatterns.idempotency.keys import normalise_key
from msgpatterns.message import Message

if TYPE_CHECKING:
    from msgpatterns.idempotency.base import Checker
    from msgpatterns.idempotency.transactional import TransactionalSqlChecker

__all__ = ["idempotent"]

P = ParamSpec("P")
R = TypeVar("R")


def _message_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Message:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Message):
            return value
    raise ConfigurationError(
        "@idempotent found no msgpatterns Message among the handler's arguments; "
        "pass key=<callable> (and fingerprint=<callable>) receiving those arguments"
    )


def message_key(*args: Any, **kwargs: Any) -> object:
    """The default key: ``message.key or message.id`` of the first Message argument."""
    message = _message_in(args, kwargs)
    return message.key or message.id


def message_payload(*args: Any, **kwargs: Any) -> object:
    """The default fingerprinted payload: the first Message argument's ``raw_body``."""
    return _message_in(args, kwargs).raw_body


@overload
def idempotent(
    checker: TransactionalSqlChecker,
    key: Callable[..., object] | None = None,
    *,
    group: str | None = None,
    fingerprint: bool | Callable[..., object] = False,
    on_duplicate: Callable[..., Any] | None = None,
    fail_open: bool = False,
) -> Callable[[Callable[..., R]], Callable[..., R | None]]: ...


@overload
def idempotent(
    checker: Checker,
    key: Callable[..., object] | None = None,
    *,
    group: str | None = None,
    fingerprint: bool | Callable[..., object] = False,
    on_duplicate: Callable[..., Any] | None = None,
    fail_open: bool = False,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


def idempotent(
    checker: Checker,
    key: Callable[..., object] | None = None,
    *,
    group: str | None = None,
    fingerprint: bool | Callable[..., object] = False,
    on_duplicate: Callable[..., Any] | None = None,
    fail_open: bool = False,
) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Run the decorated handler at most once per idempotency key.

    Args:
        checker: where keys live (MemoryChecker, RedisChecker, SqlChecker,
            TransactionalSqlChecker). With TransactionalSqlChecker the handler gets
            the open transaction as keyword argument ``tx`` and must write through it.
        key: called with exactly the handler's arguments (``tx`` excluded), returns
            the key (str, bytes or int). Default: ``message.key or message.id`` of the
            first :class:`~msgpatterns.Message` argument.
        group: second part of the stored key (``namespace:group:key``), so two
            handlers of one message each run once. Default: the handler's
            ``module.qualname``; set it explicitly to keep keys across renames.
        fingerprint: True to fingerprint the Message's ``raw_body``, or a callable on
            the handler's arguments returning the payload. The same key with another
            payload raises :class:`~msgpatterns.errors.IdempotencyConflict` (a
            Reject: dead-lettered).
        on_duplicate: called with the handler's arguments instead of the handler when
            the key is DONE; its result is returned. Use it to ack in a raw pika
            callback. Default: return None (the Consumer then acks).
        fail_open: when the store stays unreachable, run the handler WITHOUT dedup
            (logged, counted) instead of raising NeedRetry. Off by default.

    The wrapper returns the handler's result, or ``on_duplicate``'s (None by
    default) for a duplicate. It raises :class:`~msgpatterns.errors.InProgress`
    while another consumer holds the key, :class:`~msgpatterns.errors.NeedRetry` when
    the store is unreachable, :class:`~msgpatterns.errors.MalformedMessage` when the
    key cannot be computed, and whatever the handler raises (the key is released).
    Duplicates are never an error: they are logged at debug and counted in
    ``checker.stats.duplicates``.
    """
    key_of = key if key is not None else message_key
    payload_of: Callable[..., object] | None
    if fingerprint is True:
        payload_of = message_payload
    elif callable(fingerprint):
        payload_of = fingerprint
    else:
        payload_of = None
    passes_tx = checker.passes_tx

    def decorate(fn: Callable[..., R]) -> Callable[..., R | None]:
        name = group if group is not None else f"{fn.__module__}.{fn.__qualname__}"
        checker.store_key("probe", name)  # a bad group fails here, not per message

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> R | None:
            try:
                raw = normalise_key(key_of(*args, **kwargs))
            except ConfigurationError:
                raise
            except Exception as exc:
                raise MalformedMessage(f"no usable idempotency key: {exc}") from exc
            prints = None if payload_of is None else fingerprint_of(payload_of(*args, **kwargs))
            if passes_tx:
                def call(tx: Any) -> R:
                    return fn(*args, tx=tx, **kwargs)
            else:
                def call(tx: Any) -> R:
                    return fn(*args, **kwargs)
            outcome = checker.execute(raw, call, group=name, fingerprint=prints,
                                      fail_open=fail_open)
            if outcome.ran:
                return outcome.result
            return on_duplicate(*args, **kwargs) if on_duplicate is not None else None

        return wrapper

    return decorate
