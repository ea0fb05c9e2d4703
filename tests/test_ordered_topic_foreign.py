"""A foreign publisher (``redis-cli``, no msgpatterns) publishes into an ordered topic by
the recipe of docs/ordering.md ("Publishing from another language"): it reads the
route from the RedisRouteStore's keys, computes the logic partition with CRC-32 and
``XADD``s to the physical partition. A split in the middle of its messages does not
break their order."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from msgpatterns import Message

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


class RedisCli:
    """``redis-cli`` against the test server: the foreign publisher's only tool."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.args = ["redis-cli", "-h", parts.hostname or "127.0.0.1",
                     "-p", str(parts.port or 6379), "-n", parts.path.strip("/") or "0"]

    def __call__(self, *args: str) -> str:
        done = subprocess.run([*self.args, *args], capture_output=True, text=True,
                              timeout=30, check=True)
        return done.stdout.strip()


@pytest.fixture
def cli(redis_url: str) -> RedisCli:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    return RedisCli(redis_url)


@pytest.fixture
def names(redis_url: str, unique: str) -> Iterator[tuple[str, str]]:
    import redis

    name, prefix = f"foreign-orders-{unique}", f"test-routes-{unique}"
    yield name, prefix
    client = redis.Redis.from_url(redis_url)
    keys = [*client.scan_iter(match=f"{name}*"), *client.scan_iter(match=f"{prefix}:*")]
    if keys:
        client.delete(*keys)
    client.close()


def foreign_publish(cli: RedisCli, name: str, prefix: str, key: str, body: str) -> int:
    """Publish as the docs tell another language to; returns the physical partition."""
    state = f"{prefix}:{{{name}}}:state"
    route_json = cli("HGET", state, "pending") or cli(
        "HGET", f"{prefix}:{{{name}}}:history", cli("HGET", state, "version"))
    route = json.loads(route_json)
    logic = zlib.crc32(key.encode("utf-8")) % route["logic_partitions"]
    physical: int = next(p for p, start, stop in route["segments"] if start <= logic < stop)
    headers = json.dumps({"x-msgpatterns-key": key,
                          "x-msgpatterns-logic-partition": str(logic),
                          "x-msgpatterns-route-version": str(route["version"])})
    cli("XADD", f"{name}.{physical}", "*", "body", body, "headers", headers)
    return physical


def test_a_foreign_publisher_keeps_order_through_a_split(
        cli: RedisCli, names: tuple[str, str], redis_url: str) -> None:
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker
    from msgpatterns.ordering import OrderedTopic, RedisRouteStore

    name, prefix = names
    broker = RedisStreamsBroker(redis_url)
    store = RedisRouteStore(redis_url, prefix=prefix)
    topic = OrderedTopic(broker, name, routes=store, route_cache=0.0, fence=0.0)
    topic.create(physical=2)
    key, other = "acct-7", "acct-8"
    before = {foreign_publish(cli, name, prefix, key, f"{key}:{i}") for i in range(3)}
    foreign_publish(cli, name, prefix, other, f"{other}:0")
    [physical] = before
    split = topic.split(physical)
    after = {foreign_publish(cli, name, prefix, key, f"{key}:{i}") for i in range(3, 6)}
    foreign_publish(cli, name, prefix, other, f"{other}:1")
    assert after <= set(split.opened)  # the recipe follows the new route

    handled: list[tuple[str | None, bytes]] = []
    done = threading.Event()

    def handle(message: Message) -> None:
        handled.append((message.key, message.raw_body))
        if len(handled) == 8:
            done.set()

    consumer: Any = topic.consumer(handle, group="g", refresh=0.05, poll_timeout=0.05)
    consumer.start()
    try:
        assert done.wait(60), handled
    finally:
        consumer.stop(10)
        consumer.broker.close()
        broker.close()
        store.close()
    assert [body for k, body in handled if k == key] == [
        f"{key}:{i}".encode() for i in range(6)]
    assert [body for k, body in handled if k == other] == [
        f"{other}:{i}".encode() for i in range(2)]
