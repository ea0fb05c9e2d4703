"""Spark test fixtures: ONE local SparkSession per run, file-source streams, tables.

The session is ``local[2,2]`` (two cores; a failed task is attempted again, as on a
cluster) with two shuffle partitions and no UI. Streams read JSON
files from a temporary directory, one file per micro-batch, and run with
``trigger(availableNow=True)``: each ``run`` processes what is there and stops.
Without Java the Spark tests skip (fail under MSGPATTERNS_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import spark_streams
import sqlalchemy as sa
from spark_streams import FileStream, events_table, orders_table

from msgpatterns.testing import services

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    services.require("java")
    from msgpatterns.spark.local import local_spark

    session = local_spark("local[2,2]", app_name="msgpatterns-tests", shuffle_partitions=2)
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def _ship_test_code_by_value(request: pytest.FixtureRequest) -> None:
    """Functions and classes of test modules reach the Python workers by value (the
    workers cannot import test modules)."""
    from pyspark import cloudpickle

    for module in (request.module, spark_streams):
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]


@pytest.fixture
def stream(spark: SparkSession, tmp_path: Path) -> FileStream:
    return FileStream(spark, tmp_path)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The sink's database: a SQLite file, the real PostgreSQL (MariaDB when a test
    parametrizes ``db_url`` indirectly with "mysql")."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sink.db'}"
    return services.require(request.param)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    connect_args: dict[str, Any] = {"timeout": 30} if db_url.startswith("sqlite") else {}
    engine = sa.create_engine(db_url, connect_args=connect_args)
    yield engine
    engine.dispose()


def _created(engine: sa.Engine, table: sa.Table) -> Iterator[sa.Table]:
    table.create(engine)
    yield table
    table.drop(engine)


@pytest.fixture
def orders(engine: sa.Engine, unique: str) -> Iterator[sa.Table]:
    """The latest state per order (key order_id, version column)."""
    yield from _created(engine, orders_table(f"spark_orders_{unique}"))


@pytest.fixture
def events(engine: sa.Engine, unique: str) -> Iterator[sa.Table]:
    """An append-only table of events."""
    yield from _created(engine, events_table(f"spark_events_{unique}"))


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Spark Connect server per run (pyspark's own start-connect-server.sh),
    stopped by pid."""
    services.require("java")
    from msgpatterns.spark.servers import start_connect_server

    server = start_connect_server(tmp_path_factory.mktemp("spark-connect"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def connect_spark(connect_server: Any) -> Iterator[SparkSession]:
    """A Spark Connect session on that server.

    Creating it puts this process in pyspark's Connect mode (``pyspark.sql.functions``
    then build Connect columns): tests on the classic ``spark`` session must run before
    the first test that uses it (test_spark_where_it_runs.py sorts last and starts with
    its classic test). Drivers started in subprocesses get an environment without the
    mode (``msgpatterns.spark.servers.spark_env``)."""
    from pyspark.sql import SparkSession

    mode = {name: os.environ.get(name) for name in _CONNECT_MODE}
    session = SparkSession.builder.remote(connect_server.url).create()
    try:
        yield session
    finally:
        session.stop()
        # The tests after this one (and the programs they start) run classic again.
        for name, value in mode.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


#: What pyspark puts in os.environ when a Connect session is created.
_CONNECT_MODE = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One standalone master and two 1-core workers per run, stopped by pid."""
    services.require("java")
    from msgpatterns.spark.servers import start_cluster

    cluster = start_cluster(tmp_path_factory.mktemp("spark-cluster"))
    yield cluster
    cluster.stop()
