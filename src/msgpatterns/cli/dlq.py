"""``msgpatterns dlq list|show|replay|purge``: dead letters of any broker adapter.

The broker comes from the URL scheme: ``redis://`` (also ``rediss://``, ``unix://``)
for Redis Streams, ``amqp://`` / ``amqps://`` for RabbitMQ, ``kafka://host:port`` for
Kafka, ``nats://host:port`` (or ``tls://``) for NATS JetStream. ``--topic`` names the
topic (stream, exchange, subject); ``--group`` the consumer group (required for
RabbitMQ, whose dead letters live in per-group queues).

Replay sends each message back with its attempt count reset - to the group that
dead-lettered it, or with ``--to-topic`` to the topic for every group - and removes it
from the dead-letter queue only after the broker confirmed the replay.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

from msgpatterns._escape import escape_control
from msgpatterns.brokers.admin import DeadLetterAdmin
from msgpatterns.cli._options import (
    CONNECT_TIMEOUT,
    Subcommands,
    kafka_config,
    non_empty,
    positive_int,
    readable_file,
    redact_url,
    redis_client,
)
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import ConfigurationError

__all__ = ["open_admin", "register"]


class Opened:
    """A dead-letter admin opened by the command: the broker's admin, whose
    :meth:`close` also releases the broker the command opened for it."""

    def __init__(self, admin: DeadLetterAdmin, close: Callable[[], None]) -> None:
        self.admin = admin
        self._close = close

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        return self.admin.list_dead_letters(topic, group, limit=limit)

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        return self.admin.replay_dead_letters(topic, group, ids, to_topic=to_topic)

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        return self.admin.purge_dead_letters(topic, group, ids)

    def knows(self, topic: str, group: str | None = None) -> bool:
        return self.admin.knows(topic, group)

    def close(self) -> None:
        try:
            self.admin.close()
        finally:
            self._close()

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _query(url: str) -> Mapping[str, list[str]]:
    return parse_qs(urlsplit(url).query)


def _opened(broker: Any, *also: Callable[[], None]) -> Opened:
    """``broker``'s admin; closing it closes the broker, then ``also``."""

    def close() -> None:
        try:
            broker.close()
        finally:
            for release in also:
                release()

    return Opened(broker.dead_letter_admin(), close)


def _redis(url: str) -> Opened:
    """Redis Streams, on a client that gives up after CONNECT_TIMEOUT and does not
    retry (:func:`~msgpatterns.cli._options.redis_client`): an unreachable server or a
    refused login fails once, before the adapter (which retries a lost connection) is
    involved."""
    from msgpatterns.brokers.redis.broker import RedisStreamsBroker

    client = redis_client(url)
    try:
        broker = RedisStreamsBroker(client)
    except BaseException:
        client.close()
        raise
    return _opened(broker, client.close)


def _rabbitmq(url: str) -> Opened:
    """RabbitMQ, with CONNECT_TIMEOUT for the socket, the handshake and a blocked
    connection, one attempt per connect (the URL's own ``connection_attempts=...``
    etc. win). The admin needs no adapter (no I/O thread): it works on short-lived
    connections of its own."""
    from msgpatterns.brokers.rabbitmq import url_parameters
    from msgpatterns.brokers.rabbitmq.admin import RabbitMQDeadLetters

    params = url_parameters(url)  # cafile=... spelled as for both drivers
    given = _query(url)
    for option, value in (("connection_attempts", 1), ("socket_timeout", CONNECT_TIMEOUT),
                          ("stack_timeout", CONNECT_TIMEOUT),
                          ("blocked_connection_timeout", CONNECT_TIMEOUT)):
        if option not in given:
            setattr(params, option, value)
    return Opened(RabbitMQDeadLetters(params), lambda: None)


def _kafka(url: str) -> Opened:
    """Kafka, with CONNECT_TIMEOUT for connections, requests and delivery reports, and
    librdkafka's log routed to logging (silent unless --debug)."""
    from msgpatterns.brokers.kafka.broker import KafkaBroker

    return _opened(KafkaBroker(kafka_config(url), delivery_timeout=CONNECT_TIMEOUT))


def _nats(url: str, tls_ca_file: str | None = None) -> Opened:
    """NATS JetStream, giving up on an unreachable server after CONNECT_TIMEOUT;
    TLS (verified) for ``tls://`` URLs or with ``--tls-ca-file``."""
    from msgpatterns.brokers.nats.broker import NatsJetStreamBroker

    return _opened(NatsJetStreamBroker(url, connect_timeout=CONNECT_TIMEOUT,
                                       tls_ca_file=tls_ca_file))


_SCHEMES: dict[str, Callable[[str], Opened]] = {
    "redis": _redis, "rediss": _redis, "unix": _redis,
    "amqp": _rabbitmq, "amqps": _rabbitmq,
    "kafka": _kafka,
    "nats": _nats, "tls": _nats,
}


def _scheme(url: str) -> str:
    """The URL's broker scheme; a ConfigurationError (a usage error) for any other."""
    scheme = urlsplit(url).scheme
    if scheme not in _SCHEMES:
        known = ", ".join(f"{s}://" for s in _SCHEMES)
        raise ConfigurationError(
            f"unknown broker URL scheme {scheme!r} in {redact_url(url)}; use one of {known}"
        )
    return scheme


def _open(url: str, tls_ca_file: str | None = None) -> Opened:
    scheme = _scheme(url)
    if tls_ca_file is None:
        return _SCHEMES[scheme](url)
    if _SCHEMES[scheme] is not _nats:
        raise ConfigurationError(f"--tls-ca-file is for nats:// and tls:// URLs; give the "
                                 f"CA of a {scheme}:// server in its URL")
    return _nats(url, tls_ca_file)


def open_admin(url: str, *, tls_ca_file: str | None = None) -> DeadLetterAdmin:
    """The dead-letter admin for ``url``'s scheme (with the command's connect
    timeouts; ``tls_ca_file`` verifies a NATS server); its ``close()`` releases
    everything it opened."""
    return _open(url, tls_ca_file)


def register(subparsers: Subcommands) -> None:
    """Add ``dlq`` and its actions to the ``msgpatterns`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", help="redis://..., amqp://..., kafka://host:port or "
                                    "nats://host:port")
    common.add_argument("--topic", required=True, type=non_empty,
                        help="topic, stream or exchange")
    common.add_argument("--group", type=non_empty,
                        help="consumer group (required for RabbitMQ)")
    common.add_argument("--tls-ca-file", type=readable_file, metavar="PATH",
                        help="CA bundle to verify a NATS server with (implies TLS: "
                             "refused unless the server requires TLS)")

    dlq = subparsers.add_parser("dlq", help="inspect, replay and purge dead letters")
    actions = dlq.add_subparsers(dest="dlq_action", metavar="ACTION")
    actions.required = True

    listing = actions.add_parser("list", parents=[common], help="list dead letters")
    listing.add_argument("--limit", type=positive_int, default=None,
                         help="list at most this many")
    listing.add_argument("--json", action="store_true", help="one JSON record per line")
    listing.set_defaults(func=_list)

    show = actions.add_parser("show", parents=[common], help="show dead letters in full")
    show.add_argument("ids", nargs="+", metavar="ID", help="message ids")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_show, trailing="ids")

    replay = actions.add_parser("replay", parents=[common],
                                help="send dead letters back with attempts reset")
    replay.add_argument("ids", nargs="*", metavar="ID", help="message ids")
    replay.add_argument("--all", action="store_true", help="every dead letter")
    replay.add_argument("--to-topic", action="store_true",
                        help="publish to the topic for every group, not only the group "
                             "that dead-lettered it")
    replay.set_defaults(func=_replay, trailing="ids")

    purge = actions.add_parser("purge", parents=[common], help="delete dead letters")
    purge.add_argument("ids", nargs="*", metavar="ID", help="message ids")
    purge.add_argument("--all", action="store_true", help="every dead letter")
    purge.set_defaults(func=_purge, trailing="ids")


def _run(args: argparse.Namespace, action: Callable[[Opened], int]) -> int:
    """Open the admin for ``args.url``, run ``action``, close. Failures propagate to
    the command's one-line error report (:func:`msgpatterns.cli.explain`)."""
    if _scheme(args.url).startswith("amqp") and not args.group:
        raise ConfigurationError("--group is required for amqp:// URLs "
                                 "(RabbitMQ keeps dead letters per consumer group)")
    with _open(args.url, args.tls_ca_file) as opened:
        return action(opened)


def _warn_if_unknown(opened: Opened, args: argparse.Namespace) -> None:
    """Found nothing: say so on stderr when the broker does not know the topic (nor a
    dead-letter store for it) at all, i.e. a mistyped --topic or --group."""
    if opened.knows(args.topic, args.group):
        return
    of_group = f" for group {args.group!r}" if args.group else ""
    print(f"msgpatterns dlq: warning: no topic {args.topic!r}{of_group} and no "
          f"dead-letter store for it at {_text(redact_url(args.url))}: check --topic and "
          "--group",
          file=sys.stderr)


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


# Everything a dead letter carries came from its producer (or from a handler's error
# about it): each field passes through escape_control before it reaches the terminal.
# --json output is JSON with ASCII escapes, safe as it is.


def _text(value: object) -> str:
    """``value`` as one line safe to print: control characters escaped."""
    return escape_control(str(value))


def _summary(record: DeadLetter) -> str:
    return (f"{_text(record.id)}  attempts={record.attempts}  "
            f"last_failed={_when(record.last_failed_at)}  group={_text(record.group or '-')}  "
            f"{_text(record.error_type)}: {_text(record.reason)}")


def _body_text(body: Any) -> str:
    raw = body if isinstance(body, bytes) else str(body).encode()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return repr(raw[:2000])
    return _text(text if len(text) <= 2000 else text[:2000] + "...")


def _traceback_lines(text: str) -> list[str]:
    """The traceback's lines, indented (so none can pass for the command's own output),
    each with its control characters escaped."""
    lines = escape_control(text or "-", keep_newlines=True).rstrip().split("\n")
    return ["  " + line for line in lines]


def _details(record: DeadLetter) -> str:
    m = record.message
    lines = [
        f"id:            {_text(record.id)}",
        f"topic:         {_text(m.topic)}",
        f"group:         {_text(record.group or '-')}",
        f"key:           {_text(m.key)}",
        f"attempts:      {record.attempts}",
        f"first failed:  {_when(record.first_failed_at)}",
        f"last failed:   {_when(record.last_failed_at)}",
        f"error:         {_text(record.error_type)}: {_text(record.error_message)}",
        f"reason:        {_text(record.reason)}",
        f"headers:       {json.dumps(m.headers, sort_keys=True)}",
        f"body:          {_body_text(m.raw_body)}",
        "traceback:",
        *_traceback_lines(record.traceback),
    ]
    return "\n".join(lines)


def _list(args: argparse.Namespace) -> int:
    def action(opened: Opened) -> int:
        records = opened.list_dead_letters(args.topic, args.group, limit=args.limit)
        for record in records:
            print(record.to_json() if args.json else _summary(record))
        if not args.json:
            print(f"{len(records)} dead letter(s)")
        if not records:
            _warn_if_unknown(opened, args)
        return 0

    return _run(args, action)


def _show(args: argparse.Namespace) -> int:
    def action(opened: Opened) -> int:
        wanted = set(args.ids)
        found = [r for r in opened.list_dead_letters(args.topic, args.group)
                 if r.id in wanted]
        for record in found:
            print(record.to_json() if args.json else _details(record) + "\n")
        missing = wanted - {r.id for r in found}
        if missing:
            print(f"msgpatterns dlq: not found: {_text(', '.join(sorted(missing)))}",
                  file=sys.stderr)
            if not found:
                _warn_if_unknown(opened, args)
            return 1
        return 0

    return _run(args, action)


def _selection(args: argparse.Namespace) -> set[str] | None:
    """The ids to act on (None: every dead letter); a usage error unless exactly one
    of ids and --all is given."""
    if args.all == bool(args.ids):
        raise ConfigurationError("name the message ids or pass --all (not both)")
    return None if args.all else set(args.ids)


def _replay(args: argparse.Namespace) -> int:
    ids = _selection(args)

    def action(opened: Opened) -> int:
        count = opened.replay_dead_letters(args.topic, args.group, ids,
                                                 to_topic=args.to_topic)
        print(f"replayed {count} dead letter(s)")
        if not count:
            _warn_if_unknown(opened, args)
        return 0 if count or args.all else 1

    return _run(args, action)


def _purge(args: argparse.Namespace) -> int:
    ids = _selection(args)

    def action(opened: Opened) -> int:
        count = opened.purge_dead_letters(args.topic, args.group, ids)
        print(f"purged {count} dead letter(s)")
        if not count:
            _warn_if_unknown(opened, args)
        return 0 if count or args.all else 1

    return _run(args, action)
