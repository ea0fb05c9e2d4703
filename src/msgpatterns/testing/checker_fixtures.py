"""Idempotency checkers for tests: pytest fixtures and a factory for every store.

Fixtures (exposed by the msgpatterns pytest plugin):

* ``memory_checker`` - a :class:`~msgpatterns.MemoryChecker`.
* ``redis_checker`` - a :class:`~msgpatterns.RedisChecker` on fakeredis, or on the
  server at ``MSGPATTERNS_REDIS_URL`` when that variable is set (a unique namespace,
  its keys deleted afterwards).
* ``sql_checker`` - a :class:`~msgpatterns.SqlChecker` on a SQLite file in
  ``tmp_path``.

:func:`checker_for` builds any checker on any store and :func:`store_params` lists
stores as pytest parameters (real services carry their marker), for tests that run
on several stores; :class:`FakeClock` lets a test expire leases and ttls without
waiting.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from msgpatterns.errors import ConfigurationError
from msgpatterns.testing import services

if TYPE_CHECKING:
    from msgpatterns.idempotency import (
        Checker,
        MemoryChecker,
        RedisChecker,
        SqlChecker,
    )

__all__ = [
    "SQL_STORES",
    "STORES",
    "FakeClock",
    "checker_for",
    "memory_checker",
    "redis_checker",
    "sql_checker",
    "store_params",
]

#: Store names :func:`checker_for` understands. ``redis``, ``postgres`` and ``mysql``
#: need the real service (the test is skipped, or failed in CI, when it is missing).
STORES = ("memory", "fakeredis", "sqlite", "redis", "postgres", "mysql")
#: The stores a SQL checker (and TransactionalSqlChecker) runs on.
SQL_STORES = ("sqlite", "postgres", "mysql")
_MARKS = {"redis": pytest.mark.redis, "postgres": pytest.mark.postgres,
          "mysql": pytest.mark.mysql}


def store_params(*stores: str) -> list[Any]:
    """``stores`` as pytest parameters, the real services with their marker::

        @pytest.mark.parametrize("store", store_params(*STORES))
        def test_it(store, tmp_path):
            with checker_for(store, tmp_path) as checker: ...
    """
    unknown = set(stores) - set(STORES)
    if unknown:
        raise ConfigurationError(
            f"unknown store(s) {sorted(unknown)}; expected some of {STORES}")
    return [pytest.param(store, marks=_MARKS[store]) if store in _MARKS else store
            for store in stores]


class FakeClock:
    """A clock for checkers' ``clock=``: seconds since the epoch, moved by the test."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move ``seconds`` forward."""
        self.now += seconds


def _redis_client(store: str) -> Any:
    if store == "fakeredis":  # a test double: in msgpatterns[testing], not [redis]
        from msgpatterns._extras import require

        return require("fakeredis", "testing").FakeRedis()
    return services.require("redis")


@contextmanager
def checker_for(
    store: str, tmp_path: Path, *, transactional: bool = False, **options: Any,
) -> Iterator[Checker]:
    """A checker on ``store`` (one of :data:`STORES`), cleaned up afterwards.

    ``transactional=True`` builds a TransactionalSqlChecker (SQL stores only);
    ``options`` go to the checker (``ttl``, ``lease``, ``clock``, ``policy``...). Each
    call gets its own namespace or table, so tests may share real servers.
    """
    suffix = uuid.uuid4().hex[:10]
    checker: Any
    if store == "memory":
        from msgpatterns.idempotency import MemoryChecker

        checker = MemoryChecker(**options)
        yield checker
        return
    if store in ("fakeredis", "redis"):
        from msgpatterns.idempotency import RedisChecker

        options.pop("clock", None)  # Redis keeps time itself
        namespace = options.pop("namespace", f"test-{suffix}")
        checker = RedisChecker(_redis_client(store), namespace, **options)
        try:
            yield checker
        finally:
            keys = list(checker.client.scan_iter(match=f"{namespace}:*", count=1000))
            if keys:
                checker.client.delete(*keys)
            checker.close()
        return
    if store == "sqlite":
        url = f"sqlite:///{tmp_path / f'dedup-{suffix}.db'}"
    elif store in ("postgres", "mysql"):
        url = services.require(store)
    else:
        raise ConfigurationError(f"unknown store {store!r}; expected one of {STORES}")
    from msgpatterns.idempotency import SqlChecker, TransactionalSqlChecker

    if transactional:
        options.pop("lease", None)
        checker = TransactionalSqlChecker(url, f"dedup_{suffix}", **options)
    else:
        checker = SqlChecker(url, f"dedup_{suffix}", **options)
    try:
        yield checker
    finally:
        checker.store.table.drop()
        checker.close()


@pytest.fixture
def memory_checker() -> MemoryChecker:
    """A fresh in-process checker."""
    from msgpatterns.idempotency import MemoryChecker

    return MemoryChecker()


@pytest.fixture
def redis_checker(tmp_path: Path) -> Iterator[RedisChecker]:
    """A RedisChecker on fakeredis, or on MSGPATTERNS_REDIS_URL's server when set."""
    store = "redis" if os.environ.get("MSGPATTERNS_REDIS_URL") else "fakeredis"
    with checker_for(store, tmp_path) as checker:
        yield cast("RedisChecker", checker)


@pytest.fixture
def sql_checker(tmp_path: Path) -> Iterator[SqlChecker]:
    """A SqlChecker on a SQLite file in ``tmp_path``."""
    with checker_for("sqlite", tmp_path) as checker:
        yield cast("SqlChecker", checker)
