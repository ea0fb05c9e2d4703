"""``msgpatterns topic create|show|split|merge|move``: operate an ordered topic.

An ordered topic (:class:`~msgpatterns.ordering.OrderedTopic`) keeps per-key order
while its physical partitions are split, merged and moved. Its physical partitions
live on the broker of URL (``redis://`` Redis Streams, ``amqp://`` RabbitMQ,
``kafka://host:port``, ``nats://host:port``); its versioned routes in the route store
of ``--routes`` (``redis://...`` for a RedisRouteStore, any SQLAlchemy URL such as
``sqlite:///routes.db`` or ``postgresql+psycopg://...`` for a SqlRouteStore; by
default the broker URL when that is a Redis URL).

``show`` reads only the route store. ``split``, ``merge`` and ``move`` append the
command message to each closed partition on the broker, then commit the next route
version: running consumers follow it on their own, one version at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any
from urllib.parse import urlsplit

from msgpatterns._escape import escape_control
from msgpatterns.cli._options import (
    CONNECT_TIMEOUT,
    Subcommands,
    kafka_config,
    non_empty,
    non_negative_int,
    positive_int,
    redact_url,
    redis_client,
    sql_engine,
)
from msgpatterns.errors import ConfigurationError

__all__ = ["open_broker", "open_route_store", "register", "route_rows"]

_REDIS = ("redis", "rediss", "unix")
_BROKERS = (*_REDIS, "amqp", "amqps", "kafka", "nats", "tls")


# -- opening what the command talks to -------------------------------------------------


@contextmanager
def open_broker(url: str) -> Iterator[Any]:
    """The :class:`~msgpatterns.brokers.Broker` of ``url``'s scheme, with the command's
    connect timeouts; closed (with what it opened) when the block ends."""
    scheme = urlsplit(url).scheme
    if scheme not in _BROKERS:
        known = ", ".join(f"{s}://" for s in _BROKERS)
        raise ConfigurationError(
            f"unknown broker URL scheme {scheme!r} in {redact_url(url)}; use one of {known}")
    with ExitStack() as stack:  # closes in reverse: the broker, then its client
        broker: Any
        if scheme in _REDIS:
            from msgpatterns.brokers.redis.broker import RedisStreamsBroker

            client = redis_client(url)
            stack.callback(client.close)
            broker = RedisStreamsBroker(client)
        elif scheme.startswith("amqp"):
            from msgpatterns.brokers.rabbitmq.broker import RabbitMQBroker

            broker = RabbitMQBroker(url, connect_timeout=CONNECT_TIMEOUT)
        elif scheme == "kafka":
            from msgpatterns.brokers.kafka.broker import KafkaBroker

            broker = KafkaBroker(kafka_config(url), delivery_timeout=CONNECT_TIMEOUT)
        else:
            from msgpatterns.brokers.nats.broker import NatsJetStreamBroker

            broker = NatsJetStreamBroker(url, connect_timeout=CONNECT_TIMEOUT)
        stack.callback(broker.close)
        yield broker


@contextmanager
def open_route_store(url: str, prefix: str | None = None) -> Iterator[Any]:
    """The route store of ``url``: a RedisRouteStore for ``redis://`` (``rediss://``,
    ``unix://``), else a SqlRouteStore on the SQLAlchemy URL; closed when the block
    ends. ``prefix`` is the store's key or table prefix (None: its default)."""
    options = {} if prefix is None else {"prefix": prefix}
    with ExitStack() as stack:
        if urlsplit(url).scheme in _REDIS:
            from msgpatterns.ordering.redis_routes import RedisRouteStore

            client = redis_client(url)
            stack.callback(client.close)
            yield RedisRouteStore(client, **options)
            return
        from msgpatterns.ordering.sql_routes import SqlRouteStore

        engine = sql_engine(url)
        stack.callback(engine.dispose)
        yield SqlRouteStore(engine, **options)


# -- the parser ------------------------------------------------------------------------


def register(subparsers: Subcommands) -> None:
    """Add ``topic`` and its actions to the ``msgpatterns`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", help="the broker: redis://..., amqp://..., "
                                    "kafka://host:port or nats://host:port")
    common.add_argument("--topic", required=True, type=non_empty,
                        help="the ordered topic's name")
    common.add_argument("--routes", type=non_empty, metavar="URL",
                        help="the route store: redis://... or an SQLAlchemy URL such as "
                             "sqlite:///routes.db (default: the broker URL, if Redis)")
    common.add_argument("--routes-prefix", type=non_empty, metavar="PREFIX",
                        help="the route store's key or table prefix (default: the "
                             "store's own)")

    topic = subparsers.add_parser(
        "topic", help="create, show, split, merge and move ordered topics",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    actions = topic.add_subparsers(dest="topic_action", metavar="ACTION")
    actions.required = True

    create = actions.add_parser("create", parents=[common],
                                help="create the topic (idempotent)")
    create.add_argument("--partitions", type=positive_int, required=True,
                        help="physical partitions of the first route version")
    create.add_argument("--logic-partitions", type=positive_int, default=1024,
                        help="logic partitions, fixed for the topic's life (default 1024)")
    create.set_defaults(func=_create)

    show = actions.add_parser("show", parents=[common],
                              help="the route history as a table")
    show.add_argument("--group", type=non_empty,
                      help="also the group's leases and recorded command messages")
    show.add_argument("--json", action="store_true", help="one JSON document")
    show.set_defaults(func=_show)

    split = actions.add_parser("split", parents=[common],
                               help="split a physical partition in two")
    split.add_argument("physical", type=non_negative_int, help="the partition to split")
    split.add_argument("--at", type=non_negative_int, default=None,
                       help="the first logic partition of the upper half "
                            "(default: the middle of its range)")
    split.set_defaults(func=_change("split"))

    merge = actions.add_parser("merge", parents=[common],
                               help="merge two partitions with adjacent ranges")
    merge.add_argument("a", type=non_negative_int, help="a physical partition")
    merge.add_argument("b", type=non_negative_int, help="its neighbour")
    merge.set_defaults(func=_change("merge"))

    move = actions.add_parser("move", parents=[common],
                              help="move a partition's range to a new partition")
    move.add_argument("physical", type=non_negative_int, help="the partition to move")
    move.set_defaults(func=_change("move"))


# -- the actions -----------------------------------------------------------------------


def _routes_url(args: argparse.Namespace) -> str:
    if args.routes:
        return str(args.routes)
    if urlsplit(args.url).scheme in _REDIS:
        return str(args.url)
    raise ConfigurationError("--routes is required unless the broker URL is a Redis URL "
                             "(e.g. --routes sqlite:///routes.db)")


def _run(opening: AbstractContextManager[Any], action: Callable[[Any], int]) -> int:
    """Run ``action`` on what ``opening`` opens (:func:`_topic` or :func:`_routes`);
    exit code 1 with one line on stderr when the topic does not exist. Other failures
    propagate to the command's one-line error report (:func:`msgpatterns.cli.explain`).
    """
    try:
        with opening as opened:
            return action(opened)
    except _NoTopic as exc:
        print(f"msgpatterns topic: {escape_control(exc)}", file=sys.stderr)
        return 1


class _NoTopic(LookupError):
    """The topic is not in the route store."""


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[tuple[Any, int]]:
    """The route store of ``args`` and the topic's number of logic partitions (given
    to ``create``, else read from the store: _NoTopic when the topic is unknown)."""
    with open_route_store(_routes_url(args), args.routes_prefix) as store:
        logic = getattr(args, "logic_partitions", None)
        if logic is None:
            state = store.state(args.topic)
            if state is None:
                raise _NoTopic(f"no ordered topic {args.topic!r} in the route store: "
                               "create it with 'msgpatterns topic create'")
            logic = state.committed.logic_partitions
        yield store, logic


@contextmanager
def _routes(args: argparse.Namespace) -> Iterator[Any]:
    """The route store of ``args``, for an existing topic (``show`` needs no broker)."""
    with _store(args) as (store, _logic):
        yield store


@contextmanager
def _topic(args: argparse.Namespace) -> Iterator[Any]:
    """The OrderedTopic of ``args`` on its broker and route store."""
    from msgpatterns.ordering import OrderedTopic

    with _store(args) as (store, logic), open_broker(args.url) as opened:
        yield OrderedTopic(opened, args.topic, routes=store, logic_partitions=logic)


def route_rows(history: list[Any]) -> list[dict[str, Any]]:
    """The route history as plain rows (``show --json``): version, change, closed,
    opened and each open physical partition's logic range ``[start, stop)``."""
    return [{
        "version": route.version,
        "change": route.kind,
        "closed": list(route.closed),
        "opened": list(route.opened),
        "partitions": [{"physical": s.physical, "start": s.start, "stop": s.stop}
                       for s in route.segments],
    } for route in history]


def _ids(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values)) or "-"


def _ranges(route: Any) -> str:
    return "  ".join(f"{s.physical}:[{s.start},{s.stop})" for s in route.segments)


def _table(history: list[Any]) -> list[str]:
    rows = [("version", "change", "closed -> opened", "partitions (physical:[logic range))")]
    rows += [(str(r.version), r.kind, f"{_ids(r.closed)} -> {_ids(r.opened)}", _ranges(r))
             for r in history]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return ["  ".join([*(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)),
                       row[3]]).rstrip() for row in rows]


def _create(args: argparse.Namespace) -> int:
    def action(topic: Any) -> int:
        existed = topic.store.state(args.topic) is not None
        route = topic.create(physical=args.partitions)
        name = escape_control(args.topic)
        if existed:
            print(f"topic {name} exists at route version {route.version} "
                  f"({len(route.segments)} partition(s)); left as it is")
        else:
            print(f"created topic {name}: {len(route.segments)} partition(s) over "
                  f"{route.logic_partitions} logic partitions")
        print(f"  {_ranges(route)}")
        return 0

    return _run(_topic(args), action)


def _show(args: argparse.Namespace) -> int:
    def action(store: Any) -> int:
        state = store.state(args.topic)
        history = store.history(args.topic)
        group: dict[str, Any] | None = None
        if args.group:
            now = time.time()
            group = {
                "group": args.group,
                "members": store.members(args.topic, args.group, now),
                "leases": {str(p): o for p, o in sorted(
                    store.leases(args.topic, args.group, now).items())},
                "commands_recorded": [[v, p] for v, p in sorted(
                    store.commands(args.topic, args.group))],
            }
        if args.json:
            print(json.dumps({
                "topic": args.topic,
                "logic_partitions": state.committed.logic_partitions,
                "version": state.committed.version,
                "routes": route_rows(history),
                "pending": route_rows([state.pending])[0] if state.pending else None,
                **({"consumers": group} if group is not None else {}),
            }, ensure_ascii=True))
            return 0
        print(f"topic {escape_control(args.topic)}: route version "
              f"{state.committed.version}, {state.committed.logic_partitions} logic "
              "partitions")
        for line in _table(history):
            print(line)
        if state.pending is not None:
            print(f"pending: {state.pending.describe()} (command messages being "
                  "appended; the next change finishes it)")
        else:
            print("pending: none")
        if group is not None:
            leases = ", ".join(f"{p} by {escape_control(o)}"
                               for p, o in group["leases"].items()) or "none"
            recorded = ", ".join(f"v{v}:{p}" for v, p in group["commands_recorded"]) \
                or "none"
            print(f"group {escape_control(args.group)}: {len(group['members'])} live "
                  f"member(s); leases: {leases}; commands recorded: {recorded}")
        return 0

    return _run(_routes(args), action)


def _change(kind: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        def action(topic: Any) -> int:
            if kind == "split":
                route = topic.split(args.physical, at=args.at)
            elif kind == "merge":
                route = topic.merge(args.a, args.b)
            else:
                route = topic.move(args.physical)
            print(f"topic {escape_control(args.topic)}: {route.describe()}")
            print(f"  {_ranges(route)}")
            return 0

        return _run(_topic(args), action)

    run.__name__ = f"_{kind}"
    return run


