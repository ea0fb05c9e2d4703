"""upsert_latest: write a DataFrame's newest version of each key to a SQL table.

Inside the batch, Spark keeps one row per key: the highest version (ties broken by the
other columns, so a re-run picks the same row). Executors then write their partitions
in chunks with :class:`~msgpatterns.ordering.VersionGuard`'s latest-wins statement: an
existing row is replaced only by a strictly newer version. Re-running a batch, or the
rest of a half-written one, therefore changes nothing that is already there - and
versions arriving out of order, within a batch or across batches, leave the newest in
the table.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError, MalformedMessage
from msgpatterns.idempotency import StorePolicy
from msgpatterns.ordering.errors import MissingVersion
from msgpatterns.spark.resources import SqlSpec

require("sqlalchemy", "spark")


if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame
    from sqlalchemy import URL

    from msgpatterns.ordering.version_guard import VersionGuard

__all__ = ["UpsertResult", "upsert_latest"]

# Helper columns of the per-key aggregate (names no user table is likely to have).
_LATEST = "__msgpatterns_latest"
_ROWS = "__msgpatterns_rows"
_MISSING = "__msgpatterns_missing_version"
# Columns of the per-partition counts the write yields.
_KEYS = "__msgpatterns_keys"
_WRITTEN = "__msgpatterns_written"
_COUNTS = f"{_ROWS} long, {_KEYS} long, {_WRITTEN} long"


@dataclass(frozen=True)
class UpsertResult:
    """What one :func:`upsert_latest` call did.

    Attributes:
        rows: rows in the DataFrame.
        keys: distinct keys, i.e. rows sent to the database (the newest per key).
        written: rows inserted or overwritten; ``keys - written`` were not newer than
            what the table held (stale or replayed). Exact on PostgreSQL and SQLite;
            on MySQL/MariaDB read from the stored versions just before each write.
    """

    rows: int
    keys: int
    written: int

    @property
    def stale(self) -> int:
        """Keys whose version was not newer than the stored one (left unchanged)."""
        return self.keys - self.written


@dataclass(frozen=True)
class _Target:
    """Where a partition writes: picklable, rebuilt in every worker process."""

    sql: SqlSpec
    table: str
    schema: str | None
    key: tuple[str, ...]
    version: str
    policy: StorePolicy

    def guard(self) -> VersionGuard:
        from msgpatterns.ordering.version_guard import VersionGuard

        table = self.sql.table(self.table, self.schema)
        return VersionGuard(table, key=list(self.key), version=self.version)


class _WritePartition:
    """The ``mapInArrow`` function: one connection, chunks of ``batch_size`` rows,
    each chunk one statement in its own transaction (retried on a lost connection);
    yields one row of counts (input rows, keys, rows written) for the partition.

    On PostgreSQL through psycopg 3 a chunk is COPYed into a staging table and written
    by one ``INSERT ... SELECT ... ON CONFLICT DO UPDATE ... WHERE`` older: Spark already
    keeps one row per key, so the rows go as they are, without a per-row mapping.
    """

    def __init__(self, target: _Target, batch_size: int) -> None:
        self.target = target
        self.batch_size = batch_size

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        rows, keys, written = self._write(batches)
        yield pa.RecordBatch.from_pydict({_ROWS: pa.array([rows], pa.int64()),
                                          _KEYS: pa.array([keys], pa.int64()),
                                          _WRITTEN: pa.array([written], pa.int64())})

    def _write(self, batches: Iterator[pa.RecordBatch]) -> tuple[int, int, int]:
        from msgpatterns.sql_sink import copy_connection

        tally = [0]  # input rows behind the records read so far
        names: list[str] = []
        records = self._records(batches, tally, names)
        chunk = list(islice(records, self.batch_size))
        if not chunk:
            return 0, 0, 0  # an empty partition opens no connection
        target = self.target
        guard = target.guard()
        from msgpatterns._sql import transient_errors

        transient = transient_errors()
        keys = written = 0
        with target.sql.engine().connect() as conn:
            while chunk:
                def write(chunk: list[tuple[Any, ...]] = chunk) -> int:
                    with conn.begin():
                        raw = copy_connection(conn)
                        if raw is not None:
                            return guard._copy_upsert(conn, raw, names, chunk)
                        return guard.upsert_latest_many(
                            conn, [dict(zip(names, values, strict=True)) for values in chunk])

                written += target.policy.call(write, transient,
                                              what=f"upsert_latest into {target.table}")
                keys += len(chunk)
                chunk = list(islice(records, self.batch_size))
        return tally[0], keys, written

    def _records(self, batches: Iterator[pa.RecordBatch], tally: list[int],
                 names: list[str]) -> Iterator[tuple[Any, ...]]:
        """The rows to write as value tuples, without the two helper columns (they come
        last; ``names`` is filled with the column names on the first batch); adds the
        input rows each stands for to ``tally[0]``."""
        key_at: list[int] = []
        for batch in batches:
            if not names:
                names.extend(batch.schema.names[:-2])
                key_at = [names.index(k) for k in self.target.key]
            columns = [column.to_pylist() for column in batch.columns]
            for row in zip(*columns, strict=True):
                values, count, missing = row[:-2], row[-2], row[-1]
                if missing or any(values[i] is None for i in key_at):
                    self._reject(dict(zip(names, values, strict=True)), count, missing)
                tally[0] += count
                yield values

    def _reject(self, record: dict[str, Any], rows: int, missing: int) -> None:
        key = tuple(record[k] for k in self.target.key)
        if any(part is None for part in key):
            raise MalformedMessage(
                f"{rows} row(s) have no {'/'.join(self.target.key)!r}; filter them out "
                "before upsert_latest"
            )
        raise MissingVersion(
            f"{missing} row(s) of key {key!r} have no {self.target.version!r}; "
            "filter them out (to a dead-letter table, say) before upsert_latest"
        )


def upsert_latest(
    df: DataFrame,
    url: str | URL,
    table: str,
    key: str | Sequence[str],
    version: str,
    batch_size: int = 1000,
    *,
    schema: str | None = None,
    engine_options: Mapping[str, Any] | None = None,
    policy: StorePolicy | None = None,
) -> UpsertResult:
    """Write the newest row of each key in ``df`` to ``table``, unless the table holds
    that version or a newer one already.

    Args:
        df: the rows (a micro-batch inside ``foreachBatch``, or any DataFrame). Its
            columns must be columns of ``table``.
        url: SQLAlchemy URL of PostgreSQL, MySQL/MariaDB or SQLite (a file). Executors
            connect with it; credentials travel with the job.
        table: an existing table whose ``key`` column(s) are its primary key or a
            unique constraint.
        key: the key column, or several.
        version: the version column (an integer or a timestamp; higher is newer).
        batch_size: rows per statement and transaction.
        schema: the table's schema, if not the default one.
        engine_options: keyword arguments for ``sqlalchemy.create_engine``.
        policy: retries of a chunk whose connection failed transiently.

    Raises :class:`~msgpatterns.errors.ConfigurationError` (on the driver, before any
    write) for a missing table or column or a key that is not unique. A row without a
    version or key fails the job with ``MissingVersion`` / ``MalformedMessage``: filter
    such rows out first. A failed job may have written some chunks; running the batch
    again is safe.

    One ``mapInArrow`` job (no RDD, no accumulator: classic and Spark Connect
    sessions alike); the counts come back with its result.
    """
    require("pyspark", "spark")
    from pyspark.sql import functions as F

    keys = (key,) if isinstance(key, str) else tuple(key)
    if batch_size < 1:
        raise ConfigurationError("batch_size must be at least 1")
    target = _Target(SqlSpec.of(url, engine_options), table, schema, keys, version,
                     policy if policy is not None else StorePolicy())
    _check_columns(df, target)

    values = [c for c in df.columns if c not in keys and c != version]
    latest = (
        df.groupBy(*keys)
        .agg(
            # max of a struct compares field by field: the version first, then the rest
            F.max(F.struct(version, *values)).alias(_LATEST),
            F.count(F.lit(1)).alias(_ROWS),
            F.count_if(F.col(version).isNull()).alias(_MISSING),
        )
        .select(*keys, f"{_LATEST}.*", _ROWS, _MISSING)
    )
    totals = (latest.mapInArrow(_WritePartition(target, batch_size), _COUNTS)
              .agg(F.sum(_ROWS), F.sum(_KEYS), F.sum(_WRITTEN)).first())
    if totals is None:
        return UpsertResult(0, 0, 0)
    return UpsertResult(rows=int(totals[0] or 0), keys=int(totals[1] or 0),
                        written=int(totals[2] or 0))


def _check_columns(df: DataFrame, target: _Target) -> None:
    """Fail on the driver, before any job, when the table and ``df`` do not fit."""
    columns = set(df.columns)
    wanted = [*target.key, target.version]
    absent = [c for c in wanted if c not in columns]
    if absent:
        raise ConfigurationError(f"the DataFrame has no column(s) {absent}")
    guard = target.guard()  # reflects the table and checks the key is unique
    unknown = sorted(columns - set(guard.table.columns.keys()))
    if unknown:
        raise ConfigurationError(
            f"table {target.table!r} has no column(s) {unknown}; select the table's "
            "columns before upsert_latest"
        )
