"""``@idempotent``: a handler that runs at most once per key, whatever calls it.

It wraps any callable - a :class:`~msgpatterns.Consumer` handler taking a
:class:`~msgpatterns.Message`, a raw pika callback ``(channel, method, properties,
body)``, a confluent-kafka poll loop's ``handle(msg)`` - because the key is computed
by a callable that receives exactly the handler's arguments.

An ``async def`` handler gets an ``async def`` wrapper that awaits the handler before
anything is marked DONE, on an async checker (``AsyncRedisChecker``,
``AsyncSqlChecker``, ``AsyncTransactionalSqlChecker``, or ``MemoryChecker``, which
serves both): the same rules, through the same guard.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import (
    TYPE_CHECKING,
    Any,
    ParamSpec,
    Protocol,
    TypedDict,
    TypeVar,
    Unpack,
    cast,
    overload,
)

from msgpatterns._callables import is_async_callable, require_sync_callable
from msgpatterns.errors import ConfigurationError, MalformedMessage, MissingIdempotencyKey
from msgpatterns.idempotency.batch import GUARD_ATTRIBUTE, BatchGuard
from msgpatterns.idempotency.fingerprint import fingerprint_of
from msgpatterns.idempotency.keys import normalise_key
from msgpatterns.idempotency.results import DEFAULT_MAX_RESULT_BYTES, check_max_result_bytes
from msgpatterns.message import Message

if TYPE_CHECKING:
    from msgpatterns.idempotency.base import AsyncChecker, Checker
    from msgpatterns.idempotency.transactional import (
        AsyncTransactionalSqlChecker,
        TransactionalSqlChecker,
    )

__all__ = ["MissingIdempotencyKey", "idempotent"]

P = ParamSpec("P")
R = TypeVar("R")


def _missing_key(value: object, default_key: bool, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> MissingIdempotencyKey:
    what = "empty" if value is not None else "missing (None)"
    if default_key:
        message = _message_in(args, kwargs)
        return MissingIdempotencyKey(
            f"idempotency key {what}: message {message.id!r} on topic {message.topic!r} "
            "has neither a key nor a message id; publish it with a message id (or a "
            "key), or pass key=<callable> to @idempotent to compute the key from the "
            "message's content"
        )
    return MissingIdempotencyKey(
        f"idempotency key {what}: the key= callable of @idempotent returned {value!r} "
        "for this message; make it return a non-empty str, bytes or int (or publish "
        "the message with the field it reads)"
    )


def _default_group(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, a partial's function or a callable object."""
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    if not hasattr(target, "__qualname__"):
        target = type(target)
    return f"{target.__module__}.{target.__qualname__}"


def _require_checker(checker: object) -> None:
    """Refuse anything that is not a checker, naming the usual mistakes."""
    if (callable(getattr(checker, "execute", None)) or callable(getattr(checker, "aexecute",
                                                                        None))) \
            and callable(getattr(checker, "store_key", None)) and hasattr(checker, "passes_tx"):
        return
    if isinstance(checker, str):
        from msgpatterns.idempotency.spec import redact_url

        raise TypeError(
            f"@idempotent needs a checker, got the string {redact_url(checker)!r}; build "
            "one first: @idempotent(checker_from_url(url)) or RedisChecker(url), "
            "SqlChecker(url), TransactionalSqlChecker(url)"
        )
    if callable(checker) and not hasattr(checker, "execute") \
            and not hasattr(checker, "aexecute"):
        raise TypeError(
            f"@idempotent needs a checker, got the function {_default_group(checker)}: "
            "write @idempotent(checker), not a bare @idempotent"
        )
    raise TypeError(f"@idempotent needs a checker (MemoryChecker, RedisChecker, "
                    f"SqlChecker, TransactionalSqlChecker, or their Async* forms), got "
                    f"{type(checker).__name__}")


def _require_matching(checker: object, fn: Callable[..., Any], is_async: bool) -> None:
    """An ``async def`` handler needs an async checker, a sync one a sync checker."""
    name = type(checker).__name__
    if is_async and not callable(getattr(checker, "aexecute", None)):
        raise TypeError(
            f"handler {_default_group(fn)} is an async def, but {name} only guards sync "
            f"handlers: use Async{name} (or MemoryChecker) with @idempotent on an async def")
    if not is_async and not callable(getattr(checker, "execute", None)):
        sync_name = name.removeprefix("Async")
        raise TypeError(
            f"handler {_default_group(fn)} is a sync def, but {name} guards async def "
            f"handlers (it awaits its store): use {sync_name} for a sync handler")


def accepts_tx(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called with ``tx=`` (a ``tx`` parameter or ``**kwargs``);
    True when it has no signature to read (a builtin: trust the caller). The check
    TransactionalSqlChecker's handlers and tasks must pass."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD or (
            parameter.name == "tx" and parameter.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
        for parameter in parameters
    )


def _require_tx_parameter(fn: Callable[..., Any]) -> None:
    """A TransactionalSqlChecker handler must accept ``tx`` (or ``**kwargs``)."""
    if accepts_tx(fn):
        return
    raise ConfigurationError(
        f"handler {_default_group(fn)} has no 'tx' parameter, but TransactionalSqlChecker "
        "passes the open transaction as tx=: write def handle(message, tx) and do the "
        "handler's writes through tx"
    )


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


class IdempotentOptions(TypedDict, total=False):
    """The keyword options of :func:`idempotent` (see there)."""

    group: str | None
    fingerprint: bool | Callable[..., object]
    on_duplicate: Callable[..., Any] | None
    fail_open: bool
    store_result: bool
    max_result_bytes: int


class Guarded(Protocol):
    """What ``@idempotent(checker)`` returns: a sync handler stays sync, an ``async
    def`` handler gets an ``async def`` wrapper; a duplicate returns None (or the stored
    or ``on_duplicate`` result)."""

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]],
                 ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]: ...


class GuardedTx(Protocol):
    """:class:`Guarded` for a transactional checker: the wrapper takes the handler's
    arguments without ``tx`` (the checker passes it)."""

    @overload
    def __call__(self, fn: Callable[..., Coroutine[Any, Any, R]],
                 ) -> Callable[..., Coroutine[Any, Any, R | None]]: ...

    @overload
    def __call__(self, fn: Callable[..., R]) -> Callable[..., R | None]: ...


@overload
def idempotent(checker: TransactionalSqlChecker | AsyncTransactionalSqlChecker,
               key: Callable[..., object] | None = None,
               **options: Unpack[IdempotentOptions]) -> GuardedTx: ...


@overload
def idempotent(checker: Checker | AsyncChecker, key: Callable[..., object] | None = None,
               **options: Unpack[IdempotentOptions]) -> Guarded: ...


def idempotent(
    checker: Checker | AsyncChecker,
    key: Callable[..., object] | None = None,
    *,
    group: str | None = None,
    fingerprint: bool | Callable[..., object] = False,
    on_duplicate: Callable[..., Any] | None = None,
    fail_open: bool = False,
    store_result: bool = False,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
) -> Any:
    """Run the decorated handler at most once per idempotency key.

    Args:
        checker: where keys live (MemoryChecker, RedisChecker, SqlChecker,
            TransactionalSqlChecker). With TransactionalSqlChecker the handler gets
            the open transaction as keyword argument ``tx`` and must write through it.
            An ``async def`` handler takes an async checker: AsyncRedisChecker,
            AsyncSqlChecker, AsyncTransactionalSqlChecker (``tx`` is then an
            ``AsyncConnection``) or MemoryChecker; the wrapper is then an ``async
            def`` too, and the key becomes DONE only after the handler's body returned.
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
        store_result: keep the handler's return value (JSON-serialisable) with the
            DONE record and return it - decoded from JSON, so tuples come back as
            lists and dict keys as strings - for a duplicate, instead of running the
            handler. A result that cannot be kept (over ``max_result_bytes`` of JSON,
            or not JSON-serialisable) does not fail the call: its effect happened, so
            the key is completed without it (logged at error level, counted in
            ``stats.results_not_stored``) and a duplicate raises
            :class:`~msgpatterns.idempotency.ResultNotStored` (a Reject) saying why.
            Not combined with ``on_duplicate``.
        max_result_bytes: the largest result kept, in bytes of its JSON (64 KiB by
            default, at most 8 MiB).

    The wrapper returns the handler's result, or for a duplicate the stored result
    (``store_result``) or ``on_duplicate``'s (None by default). It raises
    :class:`~msgpatterns.errors.InProgress` while another consumer holds the key,
    :class:`~msgpatterns.errors.NeedRetry` when the store is unreachable,
    :class:`~msgpatterns.errors.MalformedMessage` when the key cannot be computed,
    and whatever the handler raises (the key is released). Duplicates are never an
    error: they are logged at debug and counted in ``checker.stats.duplicates``.

    A missing key (no ``message.key`` and no ``message.id``, or ``None``/``""`` from
    ``key``) raises :class:`MissingIdempotencyKey` (a Reject: dead-lettered with a
    reason saying how to set one), never a guess. Misuse is refused here, at decoration
    time: a missing or wrong checker (``TypeError``), a ``key``, ``fingerprint`` or
    ``on_duplicate`` that is not callable (:class:`ConfigurationError`) or is an
    ``async def`` (``TypeError``: they are called, never awaited), an ``async def``
    handler on a sync-only checker or a sync handler on an async checker
    (``TypeError`` naming the checker to use), and a transactional handler without a
    ``tx`` parameter.
    """
    _require_checker(checker)
    where = "@idempotent"
    if key is not None:
        require_sync_callable(key, what="key", where=where)
    if on_duplicate is not None:
        require_sync_callable(on_duplicate, what="on_duplicate", where=where)
    if store_result:
        check_max_result_bytes(max_result_bytes)
        if on_duplicate is not None:
            raise ConfigurationError(
                "@idempotent: store_result returns the stored result for a duplicate, "
                "on_duplicate replaces it: pass one of them")
    if not isinstance(fingerprint, bool):
        require_sync_callable(fingerprint, what="fingerprint (True, False or a callable)",
                              where=where)
    default_key = key is None
    key_of = key if key is not None else message_key
    payload_of: Callable[..., object] | None
    if fingerprint is True:
        payload_of = message_payload
    elif callable(fingerprint):
        payload_of = fingerprint
    else:
        payload_of = None
    passes_tx = checker.passes_tx

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise ConfigurationError(f"handler must be callable, got {fn!r} for {where}")
        is_async = is_async_callable(fn)
        _require_matching(checker, fn, is_async)
        if passes_tx:
            _require_tx_parameter(fn)
        name = group if group is not None else _default_group(fn)
        checker.store_key("probe", name)  # a bad group fails here, not per message

        def identify(*args: Any, **kwargs: Any) -> tuple[str | bytes, str | None]:
            """The key (normalised) and the payload fingerprint of one call."""
            try:
                value = key_of(*args, **kwargs)
            except ConfigurationError:
                raise
            except Exception as exc:
                raise MalformedMessage(f"no usable idempotency key: {exc}") from exc
            if value is None or (isinstance(value, str | bytes) and not value):
                raise _missing_key(value, default_key, args, kwargs)
            try:
                raw = normalise_key(value)
            except Exception as exc:
                raise MalformedMessage(f"no usable idempotency key: {exc}") from exc
            prints = None if payload_of is None else fingerprint_of(payload_of(*args, **kwargs))
            return raw, prints

        def stored(*args: Any, **kwargs: Any) -> tuple[str, str | None]:
            raw, prints = identify(*args, **kwargs)
            return checker.store_key(raw, name), prints

        def call_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[Any], Any]:
            """The handler's call for one message (``tx`` passed on if it takes it)."""
            if passes_tx:
                return lambda tx: fn(*args, tx=tx, **kwargs)
            return lambda tx: fn(*args, **kwargs)

        def outcome_of(outcome: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if outcome.ran or store_result:
                return outcome.result
            return on_duplicate(*args, **kwargs) if on_duplicate is not None else None

        def guarded_by(wrapper: Callable[..., Any]) -> Callable[..., Any]:
            """How a runtime running many messages at once finds the rules (batch
            claims), for the sync and the async wrapper alike."""
            setattr(wrapper, GUARD_ATTRIBUTE, BatchGuard(
                checker=checker, handler=fn, wrapper=wrapper, group=name, identify=stored,
                on_duplicate=on_duplicate, fail_open=fail_open, store_result=store_result,
                max_result_bytes=max_result_bytes))
            return wrapper

        options: dict[str, Any] = {"group": name, "fail_open": fail_open,
                                   "store_result": store_result,
                                   "max_result_bytes": max_result_bytes}

        if is_async:
            guarded = cast("AsyncChecker", checker)

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                raw, prints = identify(*args, **kwargs)
                outcome = await guarded.aexecute(raw, call_of(args, kwargs),
                                                 fingerprint=prints, **options)
                return outcome_of(outcome, args, kwargs)

            return guarded_by(awrapper)
        sync = cast("Checker", checker)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            raw, prints = identify(*args, **kwargs)
            outcome = sync.execute(raw, call_of(args, kwargs), fingerprint=prints, **options)
            return outcome_of(outcome, args, kwargs)

        return guarded_by(wrapper)

    return decorate
