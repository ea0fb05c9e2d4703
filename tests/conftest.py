"""Shared fixtures for msgpatterns' own tests.

Service fixtures hand out URLs of the real servers on this machine (skip when they are
unreachable, fail under MSGPATTERNS_REQUIRE_SERVICES=1). ``sql_url`` runs a test on
SQLite always and on PostgreSQL and MariaDB when marked tests are enabled.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from msgpatterns.testing import services

pytest_plugins = ["pytester"]


@pytest.fixture
def unique() -> str:
    """A short unique suffix for table names, stream names and key namespaces."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def redis_url() -> str:
    return services.require("redis")


@pytest.fixture
def postgres_url() -> str:
    return services.require("postgres")


@pytest.fixture
def mysql_url() -> str:
    return services.require("mysql")


@pytest.fixture
def rabbitmq_url() -> str:
    return services.require("rabbitmq")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'msgpatterns.db'}"


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ]
)
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database URL: SQLite file, the real PostgreSQL, the real MariaDB."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'msgpatterns.db'}"
    else:
        yield services.require(request.param)
