"""``msgpatterns topic create|show|split|merge|move`` run as an operator runs them (a
subprocess), on Redis Streams with its routes in Redis (a RedisRouteStore) or in a
SQLite file (a SqlRouteStore)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_harness import drain
from msgpatterns.ordering import OrderedTopic
from msgpatterns.ordering.topic import ROUTE_COMMAND, ROUTE_VERSION

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def msgpatterns(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "msgpatterns", *args],
                          capture_output=True, text=True, timeout=60)


class Setup:
    """A broker URL, a topic name and the route store options of one test."""

    def __init__(self, url: str, name: str, routes: list[str]) -> None:
        self.url = url
        self.name = name
        self.routes = routes

    def run(self, action: str, *args: str, topic: str | None = None
            ) -> subprocess.CompletedProcess[str]:
        return msgpatterns("topic", action, self.url, "--topic", topic or self.name,
                           *self.routes, *args)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _cleanup(client: object, name: str, prefix: str | None) -> None:
    patterns = [f"{name}.*", f"{name}.*:*"] + ([f"{prefix}:*"] if prefix else [])
    for pattern in patterns:
        keys = list(client.scan_iter(match=pattern))  # type: ignore[attr-defined]
        if keys:
            client.delete(*keys)  # type: ignore[attr-defined]


@pytest.fixture(params=["redis-routes", "sqlite-routes"])
def setup(request: pytest.FixtureRequest, redis_url: str, redis_client: object,
          unique: str, tmp_path: Path) -> Iterator[Setup]:
    name = f"cli-orders-{unique}"
    prefix: str | None = None
    if request.param == "redis-routes":
        prefix = f"test-routes-{unique}"
        routes = ["--routes-prefix", prefix]  # the store is the broker's Redis
    else:
        routes = ["--routes", f"sqlite:///{tmp_path / 'routes.db'}"]
    yield Setup(redis_url, name, routes)
    _cleanup(redis_client, name, prefix)


def test_create_split_merge_move_and_show_the_history(setup: Setup) -> None:
    created = setup.run("create", "--partitions", "2")
    assert created.returncode == 0, created.stderr
    assert "created topic" in created.stdout and "0:[0,512)  1:[512,1024)" in created.stdout
    again = setup.run("create", "--partitions", "5")
    assert again.returncode == 0 and "left as it is" in again.stdout

    split = setup.run("split", "1", "--at", "600")
    assert split.returncode == 0, split.stderr
    assert "v2 split 1 -> 2,3" in split.stdout
    assert "2:[512,600)  3:[600,1024)" in split.stdout
    merged = setup.run("merge", "3", "2")
    assert merged.returncode == 0, merged.stderr
    assert "v3 merge 2,3 -> 4" in merged.stdout
    moved = setup.run("move", "0")
    assert moved.returncode == 0 and "v4 move 0 -> 5" in moved.stdout

    shown = setup.run("show")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"topic {setup.name}: route version 4, 1024 logic")
    assert lines[1].split()[:4] == ["version", "change", "closed", "->"]
    assert lines[2].split() == ["1", "create", "-", "->", "0,1", "0:[0,512)", "1:[512,1024)"]
    assert lines[3].split() == ["2", "split", "1", "->", "2,3", "0:[0,512)", "2:[512,600)",
                                "3:[600,1024)"]
    assert lines[4].split() == ["3", "merge", "2,3", "->", "4", "0:[0,512)", "4:[512,1024)"]
    assert lines[5].split() == ["4", "move", "0", "->", "5", "5:[0,512)", "4:[512,1024)"]
    assert lines[6] == "pending: none"

    as_json = setup.run("show", "--json")
    assert as_json.returncode == 0
    document = json.loads(as_json.stdout)
    assert document["version"] == 4 and document["pending"] is None
    assert [r["change"] for r in document["routes"]] == ["create", "split", "merge", "move"]
    assert document["routes"][1] == {
        "version": 2, "change": "split", "closed": [1], "opened": [2, 3],
        "partitions": [{"physical": 0, "start": 0, "stop": 512},
                       {"physical": 2, "start": 512, "stop": 600},
                       {"physical": 3, "start": 600, "stop": 1024}]}


def test_a_split_appends_the_command_message_after_the_published_ones(
        setup: Setup, redis_url: str) -> None:
    """The CLI's split closes the partition on the real broker: its last message is
    the command message, and later publishes of its keys go to the new partitions."""
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker
    from msgpatterns.ordering import RedisRouteStore, SqlRouteStore

    assert setup.run("create", "--partitions", "2").returncode == 0
    broker = RedisStreamsBroker(redis_url)
    store = (SqlRouteStore(setup.routes[1]) if setup.routes[0] == "--routes"
             else RedisRouteStore(redis_url, prefix=setup.routes[1]))
    try:
        topic = OrderedTopic(broker, setup.name, routes=store, route_cache=0.0)
        keys = [k for k in (f"key-{i}" for i in range(200))
                if topic.state().committed.table()[_logic(k)] == 1][:5]
        for key in keys:
            topic.publish(key, b"before")
        assert setup.run("split", "1").returncode == 0
        got = drain(broker, topic.partition_topic(1), "g", count=len(keys) + 1, within=20)
        assert [m.raw_body for m in got[:-1]] == [b"before"] * len(keys)
        assert got[-1].headers[ROUTE_COMMAND] == "2"
        for message in got:
            broker.ack(message)
        for key in keys:
            topic.publish(key, b"after")
        after = [*drain(broker, topic.partition_topic(2), "g", within=2),
                 *drain(broker, topic.partition_topic(3), "g", within=2)]
        assert sorted(m.key or "" for m in after) == sorted(keys)
        assert {m.headers[ROUTE_VERSION] for m in after} == {"2"}
    finally:
        broker.close()
        store.close()


def _logic(key: str) -> int:
    from msgpatterns.ordering import logic_partition

    return logic_partition(key, 1024)


BAD_CHANGES = [
    (["merge", "0", "0"], "merge needs two different physical partitions"),
    (["split", "7"], "physical partition 7 is not open in route version 2"),
    (["split", "0", "--at", "900"], "split point must be an int strictly inside [0, 512)"),
    (["move", "1"], "physical partition 1 is not open"),
    (["merge", "0", "3"], "only adjacent ranges merge: 0 owns [0, 512), 3 owns [768, 1024)"),
]


def test_a_bad_change_is_one_clear_line_and_exit_code_2(setup: Setup) -> None:
    assert setup.run("create", "--partitions", "2").returncode == 0
    assert setup.run("split", "1").returncode == 0  # v2: 0:[0,512) 2:[512,768) 3:[768,1024)
    for args, says in BAD_CHANGES:
        bad = setup.run(*args)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
        assert bad.stderr.startswith("msgpatterns: error: ")
        assert says in bad.stderr, (args, bad.stderr)
        assert bad.stdout == ""
    history = json.loads(setup.run("show", "--json").stdout)["routes"]
    assert len(history) == 2  # nothing changed


def test_an_unknown_topic_is_exit_code_1(setup: Setup) -> None:
    for action in (["show"], ["split", "0"], ["merge", "0", "1"], ["move", "0"]):
        missing = setup.run(*action, topic=f"{setup.name}-never-created")
        assert missing.returncode == 1, missing.stderr
        assert "no ordered topic" in missing.stderr and "msgpatterns topic create" in \
            missing.stderr
        assert missing.stderr.count("\n") == 1


def test_topic_names_are_escaped_in_human_output(setup: Setup) -> None:
    hostile = f"{setup.name}\x1b[2J\x07\u202e"
    assert setup.run("create", "--partitions", "1", topic=hostile).returncode == 0
    shown = setup.run("show", "--group", "g\x1b]0;x\x07", topic=hostile)
    assert shown.returncode == 0, shown.stderr
    assert not CONTROL.search(shown.stdout) and "\u202e" not in shown.stdout
    assert "\\x1b[2J\\x07\\u202e" in shown.stdout
    as_json = setup.run("show", "--json", topic=hostile)
    assert json.loads(as_json.stdout)["topic"] == hostile
    assert not CONTROL.search(as_json.stdout)


def test_usage_errors() -> None:
    no_store = msgpatterns("topic", "show", "amqp://guest:guest@127.0.0.1/",
                           "--topic", "t")
    assert no_store.returncode == 2
    assert "--routes is required unless the broker URL is a Redis URL" in no_store.stderr
    scheme = msgpatterns("topic", "create", "mqtt://host", "--topic", "t",
                         "--routes", "sqlite://", "--partitions", "2")
    assert scheme.returncode == 2
    assert "unknown broker URL scheme 'mqtt'" in scheme.stderr
    negative = msgpatterns("topic", "split", "redis://h", "--topic", "t", "-1")
    assert negative.returncode == 2


def test_a_password_never_reaches_the_output() -> None:
    down = msgpatterns("topic", "show", "redis://127.0.0.1:1/0", "--topic", "t",
                       "--routes", "redis://:s3cret-pw@127.0.0.1:1/0")
    assert down.returncode == 1
    assert "cannot connect" in down.stderr and "s3cret-pw" not in down.stderr
    sql = msgpatterns("topic", "show", "redis://127.0.0.1:1/0", "--topic", "t",
                      "--routes", "postgresql+psycopg://app:s3cret-pw@127.0.0.1:1/db")
    assert sql.returncode == 1, sql.stderr
    assert "cannot connect" in sql.stderr and "s3cret-pw" not in sql.stderr
    assert sql.stderr.count("\n") == 1
