"""The newest row of each key of a DataFrame, as rows for a writer in a Python worker.

Two plans pick the same row - the highest version, ties broken by the other columns in
column order, a null below any value - because both use Spark's own orderings:

* ``"sorted"`` (the default): an exchange by key, then a sort within each partition
  by key, version and the other columns (descending, nulls last). The writer keeps the
  first row of each run of equal keys, found with Arrow kernels, so only the kept rows
  become Python values. One sort, which Spark spills to disk when it must.
* ``"aggregate"`` (the plain twin, kept for the differential tests): ``groupBy`` with
  ``max(struct(version, *others))`` and row counts; Spark plans it as a sort-based
  aggregation on both sides of the exchange (two sorts, twice the CPU here).

Nothing here imports PySpark or PyArrow at import time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from msgpatterns.errors import MalformedMessage
from msgpatterns.ordering.errors import MissingVersion

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

__all__ = ["LatestRows", "Plan", "latest_rows"]

Plan = Literal["sorted", "aggregate"]

# Helper columns of the aggregate plan (names no user table is likely to have).
_LATEST = "__msgpatterns_latest"
_ROWS = "__msgpatterns_rows"
_MISSING = "__msgpatterns_missing_version"

#: Spark types whose values Arrow compares for equality as Spark groups them.
_ATOMIC = ("BooleanType", "ByteType", "ShortType", "IntegerType", "LongType", "FloatType",
           "DoubleType", "DecimalType", "StringType", "VarcharType", "CharType",
           "BinaryType", "DateType", "TimestampType", "TimestampNTZType")


@dataclass(frozen=True)
class LatestRows:
    """How a partition's rows become one value tuple per key (picklable: it travels
    with the writer to the Python workers)."""

    key: tuple[str, ...]
    version: str
    plan: Plan

    def records(self, batches: Iterator[pa.RecordBatch], tally: list[int],
                names: list[str]) -> Iterator[tuple[Any, ...]]:
        """The newest row of each key as a value tuple (``names`` is filled with the
        column names on the first batch); adds the input rows to ``tally[0]``. Raises
        MalformedMessage for a row without a key, MissingVersion for one without a
        version."""
        if self.plan == "aggregate":
            return self._aggregated(batches, tally, names)
        return self._first_of_runs(batches, tally, names)

    # -- the sorted plan ----------------------------------------------------------------

    def _first_of_runs(self, batches: Iterator[pa.RecordBatch], tally: list[int],
                       names: list[str]) -> Iterator[tuple[Any, ...]]:
        last: tuple[Any, ...] | None = None  # the key of the previous batch's last row
        for batch in batches:
            rows = batch.num_rows
            if not rows:
                continue
            if not names:
                names.extend(batch.schema.names)
            tally[0] += rows
            keys = [batch.column(names.index(k)) for k in self.key]
            self._check(batch, names, keys)
            starts = _run_starts(keys, last)
            last = tuple(column[rows - 1].as_py() for column in keys)
            kept = batch.filter(starts)
            yield from zip(*(column.to_pylist() for column in kept.columns), strict=True)

    def _check(self, batch: pa.RecordBatch, names: list[str],
               keys: Sequence[pa.Array]) -> None:
        import pyarrow.compute as pc

        for column in keys:
            if column.null_count:
                raise MalformedMessage(
                    f"{column.null_count} row(s) have no {'/'.join(self.key)!r}; filter "
                    "them out before upsert_latest")
        version = batch.column(names.index(self.version))
        if not version.null_count:
            return
        absent = pc.is_null(version)
        at = pc.index(absent, True).as_py()
        key = tuple(column[at].as_py() for column in keys)
        same = absent
        for column, value in zip(keys, key, strict=True):
            same = pc.and_(same, pc.equal(column, value))
        raise MissingVersion(
            f"{pc.sum(same).as_py()} row(s) of key {key!r} have no {self.version!r}; "
            "filter them out (to a dead-letter table, say) before upsert_latest")

    # -- the aggregate plan -------------------------------------------------------------

    def _aggregated(self, batches: Iterator[pa.RecordBatch], tally: list[int],
                    names: list[str]) -> Iterator[tuple[Any, ...]]:
        key_at: list[int] = []
        for batch in batches:
            if not names:
                names.extend(batch.schema.names[:-2])  # the helper columns come last
                key_at = [names.index(k) for k in self.key]
            columns = [column.to_pylist() for column in batch.columns]
            for row in zip(*columns, strict=True):
                values, count, missing = row[:-2], row[-2], row[-1]
                if missing or any(values[i] is None for i in key_at):
                    self._reject(dict(zip(names, values, strict=True)), count, missing)
                tally[0] += count
                yield values

    def _reject(self, record: dict[str, Any], rows: int, missing: int) -> None:
        key = tuple(record[k] for k in self.key)
        if any(part is None for part in key):
            raise MalformedMessage(
                f"{rows} row(s) have no {'/'.join(self.key)!r}; filter them out "
                "before upsert_latest"
            )
        raise MissingVersion(
            f"{missing} row(s) of key {key!r} have no {self.version!r}; "
            "filter them out (to a dead-letter table, say) before upsert_latest"
        )


def latest_rows(df: DataFrame, key: Sequence[str], version: str,
                plan: Plan = "sorted") -> tuple[DataFrame, LatestRows]:
    """The DataFrame a writer reads with ``mapInArrow``, and how it reads it. The
    ``"sorted"`` plan needs keys Arrow can compare (atomic types); other keys take the
    ``"aggregate"`` plan."""
    from pyspark.sql import functions as F

    keys = list(key)
    values = [c for c in df.columns if c not in keys and c != version]
    if plan == "sorted" and all(type(df.schema[k].dataType).__name__ in _ATOMIC
                                for k in keys):
        ordered = df.repartition(*keys).sortWithinPartitions(
            *keys, *(F.col(c).desc_nulls_last() for c in (version, *values)))
        return ordered, LatestRows(tuple(keys), version, "sorted")
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
    return latest, LatestRows(tuple(keys), version, "aggregate")


def _run_starts(keys: Sequence[pa.Array], last: tuple[Any, ...] | None) -> pa.Array:
    """True where a row's key differs from the row before it (the previous batch's
    last key for the first row). NaN equals NaN, as Spark groups it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = len(keys[0])
    first = last is None or not _same_key(tuple(c[0].as_py() for c in keys), last)
    changed: pa.Array | None = None
    for column in keys:
        after, before = column.slice(1), column.slice(0, rows - 1)
        differs = pc.not_equal(after, before)
        if pa.types.is_floating(column.type):
            differs = pc.and_(differs, pc.invert(pc.and_(pc.is_nan(after), pc.is_nan(before))))
        changed = differs if changed is None else pc.or_(changed, differs)
    head = pa.array([first], pa.bool_())
    return head if changed is None else pa.concat_arrays([head, changed])


def _same_key(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(x == y or (isinstance(x, float) and isinstance(y, float)
                          and math.isnan(x) and math.isnan(y))
               for x, y in zip(a, b, strict=True))
