"""Failures -> one line on stderr and an exit code (see :func:`explain`)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator

from msgpatterns.cli._options import redact_url, secrets_in
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    MissingExtra,
    MsgPatternsError,
)

__all__ = ["explain", "target_of"]

#: pika's repr of the socket address it tried, appended to its timeout messages.
_PIKA_ADDRESS = re.compile(r"'[^']*'/\(<AddressFamily.*$")
_CONNECT_HINT = "is the server running, and is the URL right?"
_AUTH_HINT = "check the user name and password in the URL"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then its causes and contexts, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is(exc: BaseException, module: str, *names: str) -> bool:
    """``exc`` is an instance of one of ``module``'s ``names`` (only if the client
    library is imported already: an error cannot come from a library never loaded)."""
    loaded = sys.modules.get(module)
    types = tuple(t for t in (getattr(loaded, n, None) for n in names) if isinstance(t, type))
    return bool(types) and isinstance(exc, types)


def _text(exc: BaseException) -> str:
    """The most specific human text in ``exc``: the innermost OS error's reason, the
    driver's message of a SQLAlchemy error, else ``str(exc)``; one line."""
    for arg in _nested(exc):
        if isinstance(arg, OSError) and arg.strerror:
            return arg.strerror
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        exc = orig
    text = _safe_str(exc) or type(exc).__name__
    kafka_text = getattr(exc.args[0], "str", None) if exc.args else None
    if _is(exc, "confluent_kafka", "KafkaException") and callable(kafka_text):
        text = str(kafka_text())  # KafkaError's own text, not its repr
    elif _is(exc, "pika.exceptions", "AMQPError"):
        text = f"{type(exc).__name__}: {text}"
    text = text.split("(Background on this error", 1)[0]  # SQLAlchemy's link
    text = _PIKA_ADDRESS.sub("", text)
    return " ".join(text.split()).rstrip(" .")


def _nested(exc: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """``exc``'s chain and the exceptions nested in it (pika keeps them in ``args`` and
    in ``.exception``)."""
    if depth > 4:
        return
    for link in _chain(exc):
        yield link
        inner = [*link.args, getattr(link, "exception", None)]
        for arg in inner:
            if isinstance(arg, BaseException):
                yield from _nested(arg, depth + 1)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return ""


def _is_auth(exc: BaseException) -> bool:
    if _is(exc, "pika.exceptions", "ProbableAuthenticationError",
           "ProbableAccessDeniedError"):
        return True
    if _is(exc, "redis.exceptions", "AuthenticationError", "AuthenticationWrongNumberOfArgsError"):
        return True
    if _is(exc, "sqlalchemy.exc", "OperationalError", "InterfaceError"):
        text = _text(exc).lower()
        return any(marker in text for marker in (
            "password authentication failed", "authentication failed", "access denied",
            "no password supplied", "role \"", "no pg_hba.conf entry",
        ))
    return False


def _is_unreachable(exc: BaseException) -> bool:
    return (
        isinstance(exc, (ConnectionError, TimeoutError))
        or _is(exc, "redis.exceptions", "ConnectionError", "TimeoutError")
        or _is(exc, "pika.exceptions", "AMQPConnectionError")
        or _is(exc, "sqlalchemy.exc", "OperationalError", "InterfaceError",
               "DisconnectionError", "TimeoutError")
        or _is(exc, "confluent_kafka", "KafkaException")
    )


def _is_usage(exc: BaseException) -> bool:
    return isinstance(exc, (ValueError, MissingExtra)) \
        or _is(exc, "sqlalchemy.exc", "NoSuchModuleError", "ArgumentError")


def explain(exc: BaseException, url: str | None = None) -> tuple[int, str]:
    """The exit code and the one-line message for ``exc`` raised by a command working
    on ``url``.

    Both msgpatterns' own errors (``BrokerUnavailable``, ``ConfigurationError``, ...)
    and the client libraries' raw ones (redis-py, pika, SQLAlchemy, confluent-kafka)
    are understood, through ``__cause__``/``__context__`` chains; anything else is
    reported as an unexpected error (a bug) with exit code 1. The message never
    contains the URL's password: the URL is shown redacted, and the password is
    masked in the text of the error.
    """
    secrets = [re.compile(rf"(?<![\w%]){re.escape(s)}(?![\w%])") for s in secrets_in(url)]

    def text(error: BaseException) -> str:
        line = _text(error)
        for secret in secrets:
            line = secret.sub("***", line)
        return line

    return _classify(exc, f" {redact_url(url)}" if url else "", text)


def _classify(exc: BaseException, where: str,
              text: Callable[[BaseException], str]) -> tuple[int, str]:
    if isinstance(exc, KeyboardInterrupt):
        return 130, "interrupted"
    chain = list(_chain(exc))
    for link in chain:  # a login refused anywhere in the chain: never a retry hint
        if _is_auth(link):
            return 1, f"authentication failed at{where}: {text(link)} ({_AUTH_HINT})"
    if _is_usage(exc):
        about = "" if isinstance(exc, MsgPatternsError) or not where else f"{where.strip()}: "
        return 2, f"error: {about}{text(exc)}"
    for link in chain:
        if isinstance(link, BrokerClosed):
            return 1, f"the connection to{where} was closed: {text(link)}"
        if isinstance(link, BrokerUnavailable) or _is_unreachable(link):
            return 1, f"cannot connect to{where}: {text(_innermost(link))} ({_CONNECT_HINT})"
    for link in chain:
        if _is(link, "redis.exceptions", "RedisError") \
                or _is(link, "pika.exceptions", "AMQPError") or isinstance(link, BrokerError):
            return 1, f"the server at{where} refused the request: {text(link)}"
    return 1, (f"unexpected error: {type(exc).__name__}: {text(exc)} (run "
               "'msgpatterns --debug ...' for the traceback, and please report it)")


def _innermost(exc: BaseException) -> BaseException:
    """The client library's own error under one of ours (its text is the useful one)."""
    chain = list(_chain(exc))
    return chain[-1] if isinstance(exc, BrokerError) else exc


def target_of(args: argparse.Namespace) -> str | None:
    """The URL the command works on (dlq's URL, dedup's --url, demo's --db)."""
    for name in ("url", "db"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            return value
    return None


