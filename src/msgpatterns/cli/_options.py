"""What every ``msgpatterns`` subcommand shares: the parser class, argument types,
URL redaction and SQL URLs with a connect timeout."""

from __future__ import annotations

import argparse
import logging
from typing import Any, NoReturn, Protocol
from urllib.parse import urlsplit

from msgpatterns._redact import redact_url

__all__ = [
    "CONNECT_TIMEOUT",
    "ArgumentParser",
    "Subcommands",
    "kafka_config",
    "non_empty",
    "non_negative_int",
    "positive_int",
    "readable_file",
    "rate",
    "redact_url",
    "redis_client",
    "secrets_in",
    "sql_engine",
    "sql_url",
]

#: Seconds the command waits for a server to answer a connection (or a request)
#: before it gives up, for every backend (Redis, RabbitMQ, Kafka, SQL).
CONNECT_TIMEOUT = 5.0


class Subcommands(Protocol):
    """What a subcommand's ``register`` receives: the object
    ``ArgumentParser.add_subparsers()`` returns, of which it calls ``add_parser``."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose usage errors are one line on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# -- argument types (argparse turns their ArgumentTypeError into a usage error) -------


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _bounded_int(text, 0)


def _bounded_int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def rate(text: str) -> float:
    """A probability in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def non_empty(text: str) -> str:
    """A name that is not empty or blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError("cannot be empty")
    return text


def readable_file(text: str) -> str:
    """The path of a file that exists and can be read (a CA bundle, a certificate)."""
    try:
        with open(text, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror}") from None
    return text


# -- URLs -------------------------------------------------------------------------------


def secrets_in(url: str | None) -> list[str]:
    """The credentials in ``url`` as they may appear in a client's error text."""
    if not url:
        return []
    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
    except ValueError:
        return []
    from urllib.parse import unquote

    return [s for f in found for s in {f, unquote(f)} if s]


def sql_url(url: str) -> Any:
    """``url`` as an SQLAlchemy URL whose connections give up after
    :data:`CONNECT_TIMEOUT` seconds (unless the URL sets ``connect_timeout`` itself).

    Raises :class:`~msgpatterns.errors.ConfigurationError` (a usage error) when the URL
    cannot be parsed, names an unknown database, or its driver is not installed.
    """
    import sqlalchemy as sa

    from msgpatterns.errors import ConfigurationError

    try:
        parsed = sa.engine.make_url(url)
        parsed.get_dialect().import_dbapi()
    except sa.exc.NoSuchModuleError:
        raise ConfigurationError(
            f"unknown SQL database or driver in {redact_url(url)}: use e.g. "
            "postgresql+psycopg://, mysql+pymysql://, sqlite:///file.db"
        ) from None
    except sa.exc.ArgumentError:
        raise ConfigurationError(f"not an SQLAlchemy URL: {redact_url(url)}") from None
    except ImportError as exc:
        raise ConfigurationError(
            f"the driver {exc.name or parsed.drivername!r} for {redact_url(url)} is not "
            "installed: install it, or name an installed driver in the URL "
            "(e.g. postgresql+psycopg://, mysql+pymysql://)"
        ) from None
    if parsed.get_backend_name() in ("postgresql", "mysql", "mariadb") \
            and "connect_timeout" not in parsed.query:
        parsed = parsed.update_query_dict({"connect_timeout": str(int(CONNECT_TIMEOUT))})
    return parsed


def sql_engine(url: str) -> Any:
    """An SQLAlchemy engine for :func:`sql_url` ``(url)``."""
    import sqlalchemy as sa

    return sa.create_engine(sql_url(url))


def redis_client(url: str) -> Any:
    """A redis-py client for ``url`` that gives up after :data:`CONNECT_TIMEOUT` and
    does not retry (the URL's own ``socket_timeout=...`` options win), checked with one
    PING: an unreachable server or a refused login fails once, with the adapter's
    typed error (``BrokerUnavailable``...), before anything retries a lost connection.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from msgpatterns.brokers.redis import redis_error

    client = redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        raise redis_error(exc, redact_url(url)) from exc
    return client


#: Where librdkafka's own log lines go (off stderr unless ``msgpatterns --debug``).
_kafka_log = logging.getLogger("msgpatterns.cli.kafka")


def kafka_config(url: str) -> dict[str, Any]:
    """librdkafka settings for a ``kafka://host:port`` URL: :data:`CONNECT_TIMEOUT`
    for connections, requests and delivery reports, and librdkafka's log routed to
    logging (silent unless ``--debug``)."""
    from msgpatterns.brokers.kafka import bootstrap_servers

    timeout_ms = int(CONNECT_TIMEOUT * 1000)
    return {
        "bootstrap.servers": bootstrap_servers(f"kafka://{urlsplit(url).netloc}"),
        "socket.connection.setup.timeout.ms": timeout_ms,
        "socket.timeout.ms": timeout_ms,
        "logger": _kafka_log,
    }
