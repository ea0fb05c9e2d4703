"""The sinks from the same code on a classic local session, a standalone cluster (a
master and two 1-core workers) and Spark Connect: every table exact after resends and
a replayed batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sink_scenario
from sink_scenario import EXPECTED

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark


@pytest.fixture(autouse=True)
def _ship_the_scenario_by_value() -> None:
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sink_scenario)  # type: ignore[no-untyped-call]


def test_on_a_classic_local_session(spark: SparkSession, tmp_path: Path) -> None:
    assert sink_scenario.run(spark, tmp_path, f"sqlite:///{tmp_path / 'sink.db'}") == EXPECTED


def test_on_spark_connect(connect_spark: SparkSession, tmp_path: Path) -> None:
    assert sink_scenario.run(connect_spark, tmp_path,
                             f"sqlite:///{tmp_path / 'sink.db'}") == EXPECTED


def test_on_a_standalone_cluster(spark_cluster: Any, tmp_path: Path) -> None:
    from spark_servers import spark_env

    result = subprocess.run(
        [sys.executable, str(Path(sink_scenario.__file__)), spark_cluster.url, str(tmp_path),
         f"sqlite:///{tmp_path / 'sink.db'}"],
        capture_output=True, text=True, timeout=600, env=spark_env(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == EXPECTED


def test_what_connect_cannot_know_is_a_configuration_error(connect_spark: SparkSession) -> None:
    from msgpatterns.errors import ConfigurationError
    from msgpatterns.spark import streaming_query_id

    with pytest.raises(ConfigurationError, match=r"checkpoint=.*scope=.sink."):
        streaming_query_id(connect_spark.range(1))
