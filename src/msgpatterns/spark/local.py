"""A small local SparkSession for demos, examples, tests and benchmarks.

Local mode, offline: no UI, no console progress bar, few shuffle partitions, quiet
logs, and Python workers that run this interpreter (so they import the same
packages as the driver).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgpatterns._extras import require

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["FAST_START", "LOCAL_CONF", "drop_last_commit", "local_spark"]

#: Settings that keep a local session small and fast to start.
LOCAL_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.log.level": "ERROR",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.coalescePartitions.enabled": "false",
    "spark.driver.memory": "1g",
}

#: JVM options for a short-lived session: the client compiler and the serial collector
#: start fastest (long jobs run slower with them).
FAST_START = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"


def local_spark(
    master: str = "local[2]",
    *,
    app_name: str = "msgpatterns",
    shuffle_partitions: int = 2,
    conf: Mapping[str, Any] | None = None,
    fast_start: bool = True,
) -> SparkSession:
    """A local SparkSession (or the active one, reconfigured where Spark allows).

    ``fast_start`` tunes the JVM for short runs (tests, demos); turn it off for
    measurements.

    Sets ``PYSPARK_PYTHON`` to this interpreter unless it is set already: PySpark
    starts its Python workers with that program (``python3`` otherwise, which may
    lack the driver's packages).
    """
    require("pyspark", "spark")
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {**LOCAL_CONF, "spark.sql.shuffle.partitions": str(shuffle_partitions),
                **({"spark.driver.extraJavaOptions": FAST_START} if fast_start else {}),
                **{k: str(v) for k, v in (conf or {}).items()}}
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def drop_last_commit(checkpoint: str | Path) -> int:
    """Delete the checkpoint's last ``commits/N`` (and its ``.N.crc``), as if the driver
    had died after the sink's write and before Spark's commit; returns N.

    The next start of the query runs batch N again, with the same id and data.
    """
    commits = Path(checkpoint) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)
    return last
