"""Checker specs: a picklable URL + options from which another process rebuilds the
same checker (Spark executors, worker processes)."""

from __future__ import annotations

import pickle
from pathlib import Path

import fakeredis
import pytest
import redis

from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import (
    CheckerSpec,
    MemoryChecker,
    RedisChecker,
    SqlChecker,
    Status,
    StorePolicy,
    TransactionalSqlChecker,
    checker_from_spec,
    checker_from_url,
)

POLICY = StorePolicy(attempts=5, wait=0.2, max_wait=2.0, unavailable_delay=30.0)


def test_a_sql_checker_round_trips_with_its_options(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    original = SqlChecker(url, "orders_dedup", ttl=3600, lease=12, namespace="shop",
                          policy=POLICY, write_behind=0.01)
    spec = pickle.loads(pickle.dumps(original.spec()))
    assert spec == CheckerSpec("sql", url, {
        "table": "orders_dedup", "ttl": 3600.0, "lease": 12.0, "namespace": "shop",
        "policy": {"attempts": 5, "wait": 0.2, "max_wait": 2.0, "unavailable_delay": 30.0},
        "write_behind": 0.01,
    })
    rebuilt = checker_from_spec(spec)
    assert isinstance(rebuilt, SqlChecker)
    assert (rebuilt.ttl, rebuilt.lease, rebuilt.namespace, rebuilt.policy,
            rebuilt.write_behind) == (3600.0, 12.0, "shop", POLICY, 0.01)
    claim = original.claim("o-1", group="g")
    assert rebuilt.claim("o-1", group="g").status is Status.IN_PROGRESS  # same store
    original.complete(claim)
    assert spec.build().claim("o-1", group="g").status is Status.DONE


def test_a_transactional_checker_round_trips(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    spec = TransactionalSqlChecker(url, "t", ttl=60, namespace="ns").spec()
    rebuilt = checker_from_spec(pickle.loads(pickle.dumps(spec)))
    assert isinstance(rebuilt, TransactionalSqlChecker)
    assert (rebuilt.ttl, rebuilt.namespace, rebuilt.store.table.name) == (60.0, "ns", "t")


def test_a_redis_checker_built_from_a_client_derives_its_url() -> None:
    client = redis.Redis(host="cache.internal", port=6380, db=3, username="app",
                         password="s3cr:t@")
    spec = RedisChecker(client, namespace="shop", ttl=60, lease=5).spec()
    assert spec.kind == "redis"
    assert spec.url == "redis://app:s3cr%3At%40@cache.internal:6380/3"
    rebuilt = checker_from_spec(spec)
    assert isinstance(rebuilt, RedisChecker)
    kwargs = rebuilt.client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == \
        ("cache.internal", 6380, 3, "s3cr:t@")
    assert (rebuilt.namespace, rebuilt.ttl, rebuilt.lease) == ("shop", 60.0, 5.0)


def test_checker_from_url_picks_the_store(tmp_path: Path) -> None:
    assert isinstance(checker_from_url("redis://localhost:6379/0"), RedisChecker)
    assert isinstance(checker_from_url(f"sqlite:///{tmp_path / 'x.db'}", table="t"), SqlChecker)


@pytest.mark.parametrize("checker", [
    MemoryChecker(),
    RedisChecker(fakeredis.FakeRedis()),
    SqlChecker("sqlite://"),
], ids=["memory", "fakeredis", "sqlite-in-memory"])
def test_checkers_that_cannot_leave_their_process_say_so(checker: object) -> None:
    with pytest.raises(ConfigurationError, match="process"):
        checker.spec()  # type: ignore[attr-defined]


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown checker kind"):
        checker_from_spec(CheckerSpec("etcd", "etcd://x"))
