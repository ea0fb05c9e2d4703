"""``msgpatterns dlq list|show|replay|purge``: dead letters of any broker adapter.

The broker comes from the URL scheme: ``redis://`` (also ``rediss://``, ``unix://``)
for Redis Streams, ``amqp://`` / ``amqps://`` for RabbitMQ, ``kafka://host:port`` for
Kafka. ``--topic`` names the topic (stream, exchange); ``--group`` the consumer group
(required for RabbitMQ, whose dead letters live in per-group queues).

Replay sends each message back with its attempt count reset - to the group that
dead-lettered it, or with ``--to-topic`` to the topic for every group - and removes it
from the dead-letter queue only after the broker confirmed the replay.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from msgpatterns.brokers._dlq import DeadLetterAdmin
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import MissingExtra

__all__ = ["open_admin", "register"]

_SCHEMES: dict[str, Callable[[str], Any]] = {}


def _redis(url: str) -> Any:
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    return RedisStreamsBroker(url)


def _rabbitmq(url: str) -> Any:
    from msgpatterns.brokers.rabbitmq import RabbitMQBroker

    return RabbitMQBroker(url)


def _kafka(url: str) -> Any:
    from msgpatterns.brokers.kafka import KafkaBroker

    return KafkaBroker(url)


_SCHEMES.update({
    "redis": _redis, "rediss": _redis, "unix": _redis,
    "amqp": _rabbitmq, "amqps": _rabbitmq,
    "kafka": _kafka,
})


def open_admin(url: str) -> DeadLetterAdmin:
    """The broker adapter for ``url``'s scheme, as a dead-letter admin."""
    scheme = urlsplit(url).scheme
    make = _SCHEMES.get(scheme)
    if make is None:
        known = ", ".join(f"{s}://" for s in _SCHEMES)
        raise ValueError(f"unknown broker URL scheme {scheme!r}; use one of {known}")
    admin: DeadLetterAdmin = make(url)
    return admin


class _IntermixedParser(argparse.ArgumentParser):
    """Accepts message ids before or after the options."""

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:  # the intermixed parse calls back in here
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def register(subparsers: Any) -> None:
    """Add ``dlq`` and its actions to the ``msgpatterns`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", help="redis://..., amqp://..., or kafka://host:port")
    common.add_argument("--topic", required=True, help="topic, stream or exchange")
    common.add_argument("--group", help="consumer group (required for RabbitMQ)")

    dlq = subparsers.add_parser("dlq", help="inspect, replay and purge dead letters")
    actions = dlq.add_subparsers(dest="dlq_action", metavar="ACTION",
                                 parser_class=_IntermixedParser)
    actions.required = True

    listing = actions.add_parser("list", parents=[common], help="list dead letters")
    listing.add_argument("--limit", type=int, default=None)
    listing.add_argument("--json", action="store_true", help="one JSON record per line")
    listing.set_defaults(func=_list)

    show = actions.add_parser("show", parents=[common], help="show dead letters in full")
    show.add_argument("ids", nargs="+", metavar="ID", help="message ids")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_show)

    replay = actions.add_parser("replay", parents=[common],
                                help="send dead letters back with attempts reset")
    replay.add_argument("ids", nargs="*", metavar="ID", help="message ids")
    replay.add_argument("--all", action="store_true", help="every dead letter")
    replay.add_argument("--to-topic", action="store_true",
                        help="publish to the topic for every group, not only the group "
                             "that dead-lettered it")
    replay.set_defaults(func=_replay)

    purge = actions.add_parser("purge", parents=[common], help="delete dead letters")
    purge.add_argument("ids", nargs="*", metavar="ID", help="message ids")
    purge.add_argument("--all", action="store_true", help="every dead letter")
    purge.set_defaults(func=_purge)


def _run(args: argparse.Namespace, action: Callable[[DeadLetterAdmin], int]) -> int:
    try:
        admin = open_admin(args.url)
    except (ValueError, MissingExtra) as exc:
        print(f"msgpatterns dlq: {exc}", file=sys.stderr)
        return 2
    try:
        return action(admin)
    except ValueError as exc:
        print(f"msgpatterns dlq: {exc}", file=sys.stderr)
        return 2
    finally:
        admin.close()


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def _summary(record: DeadLetter) -> str:
    return (f"{record.id}  attempts={record.attempts}  last_failed={_when(record.last_failed_at)}"
            f"  group={record.group or '-'}  {record.error_type}: {record.reason}")


def _body_text(body: Any) -> str:
    raw = body if isinstance(body, bytes) else str(body).encode()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return repr(raw[:2000])
    return text if len(text) <= 2000 else text[:2000] + "..."


def _details(record: DeadLetter) -> str:
    m = record.message
    lines = [
        f"id:            {record.id}",
        f"topic:         {m.topic}",
        f"group:         {record.group or '-'}",
        f"key:           {m.key}",
        f"attempts:      {record.attempts}",
        f"first failed:  {_when(record.first_failed_at)}",
        f"last failed:   {_when(record.last_failed_at)}",
        f"error:         {record.error_type}: {record.error_message}",
        f"reason:        {record.reason}",
        f"headers:       {json.dumps(m.headers, sort_keys=True)}",
        f"body:          {_body_text(m.raw_body)}",
        "traceback:",
        *("  " + line for line in (record.traceback or "-").rstrip().splitlines()),
    ]
    return "\n".join(lines)


def _list(args: argparse.Namespace) -> int:
    def action(admin: DeadLetterAdmin) -> int:
        records = admin.list_dead_letters(args.topic, args.group, limit=args.limit)
        for record in records:
            print(record.to_json() if args.json else _summary(record))
        if not args.json:
            print(f"{len(records)} dead letter(s)")
        return 0

    return _run(args, action)


def _show(args: argparse.Namespace) -> int:
    def action(admin: DeadLetterAdmin) -> int:
        wanted = set(args.ids)
        found = [r for r in admin.list_dead_letters(args.topic, args.group)
                 if r.id in wanted]
        for record in found:
            print(record.to_json() if args.json else _details(record) + "\n")
        missing = wanted - {r.id for r in found}
        if missing:
            print(f"msgpatterns dlq: not found: {', '.join(sorted(missing))}",
                  file=sys.stderr)
            return 1
        return 0

    return _run(args, action)


def _selection(args: argparse.Namespace) -> set[str] | None:
    if args.all == bool(args.ids):
        raise ValueError("name the message ids or pass --all (not both)")
    return None if args.all else set(args.ids)


def _replay(args: argparse.Namespace) -> int:
    def action(admin: DeadLetterAdmin) -> int:
        count = admin.replay_dead_letters(args.topic, args.group, _selection(args),
                                          to_topic=args.to_topic)
        print(f"replayed {count} dead letter(s)")
        return 0 if count or args.all else 1

    return _run(args, action)


def _purge(args: argparse.Namespace) -> int:
    def action(admin: DeadLetterAdmin) -> int:
        count = admin.purge_dead_letters(args.topic, args.group, _selection(args))
        print(f"purged {count} dead letter(s)")
        return 0 if count or args.all else 1

    return _run(args, action)
