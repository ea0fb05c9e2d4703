"""dedup_rows: drop rows a checker has seen DONE, mark the rest DONE once written.

For sources that resend (an upstream retry, a replayed file): the same event comes back
in a later micro-batch with a new batch id, which the batch ledger cannot recognise.
A checker (Redis or SQL, the same one ``@idempotent`` consumers use) remembers the
keys whose effect was applied.

The claim happens on the executors, per partition, with one ``claim_many`` per chunk;
the survivors are cached so the write and the marking see exactly the rows that were
claimed. Marking (``complete_many``) happens only when the caller says the write
succeeded; a failed write releases the claims so a re-run writes those rows again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from types import TracebackType
from typing import TYPE_CHECKING, Any

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.base import BatchChecker, Checker
from msgpatterns.idempotency.records import Claim, Status
from msgpatterns.idempotency.spec import CheckerSpec, checker_from_url
from msgpatterns.spark.resources import checker_for

if TYPE_CHECKING:
    from pyspark import Accumulator
    from pyspark.sql import DataFrame, Row

__all__ = ["DedupStats", "DedupedRows", "dedup_rows"]

log = logging.getLogger("msgpatterns.spark")

#: Keys per claim/complete round trip.
CHUNK = 1000

_STORE_KEY = "__msgpatterns_dedup_key"
_TOKEN = "__msgpatterns_dedup_token"
#: Checker kinds whose state other processes can see.
_SHARED_KINDS = ("redis", "sql")


@dataclass(frozen=True)
class DedupStats:
    """Counts of one :func:`dedup_rows` call (distinct keys of the batch)."""

    kept: int
    dropped: int
    in_progress: int


class _ClaimPartition:
    """``mapPartitions``: claim each key; drop DONE keys; keep claimed and in-progress
    ones, with the claim's store key and token (None when not ours)."""

    def __init__(self, spec: CheckerSpec, key: str, group: str,
                 counters: tuple[Accumulator[int], Accumulator[int]]) -> None:
        self.spec = spec
        self.key = key
        self.group = group
        self.counters = counters

    def __call__(self, partition: Iterable[Row]) -> Iterator[tuple[Any, ...]]:
        rows = iter(partition)
        checker = _batch_checker(self.spec)
        dropped = in_progress = 0
        while chunk := list(islice(rows, CHUNK)):
            claims = checker.claim_many([row[self.key] for row in chunk], group=self.group)
            for row, claim in zip(chunk, claims, strict=True):
                if claim.status is Status.DONE:
                    dropped += 1
                    continue
                if claim.status is not Status.CLAIMED:
                    in_progress += 1  # someone else's lease: written, at least once
                yield (*row, claim.key, claim.token)
        self.counters[0].add(dropped)
        self.counters[1].add(in_progress)


class _SettlePartition:
    """``foreachPartition`` over (key, store key, token): complete or release the claims.

    Completing also marks keys that were in progress at claim time when their lease has
    expired since; a key another owner still holds is left to that owner.
    """

    def __init__(self, spec: CheckerSpec, group: str, complete: bool,
                 counter: Accumulator[int]) -> None:
        self.spec = spec
        self.group = group
        self.complete = complete
        self.counter = counter

    def __call__(self, rows: Iterator[Row]) -> None:
        checker = _batch_checker(self.spec)
        settled = 0
        while chunk := list(islice(rows, CHUNK)):
            ours = [Claim(r[1], Status.CLAIMED, r[2]) for r in chunk if r[2] is not None]
            if not self.complete:
                settled += sum(checker.release_many(ours)) if ours else 0
                continue
            others = [r[0] for r in chunk if r[2] is None]
            if others:
                ours += [c for c in checker.claim_many(others, group=self.group) if c.claimed]
            settled += sum(checker.complete_many(ours)) if ours else 0
        self.counter.add(settled)


class DedupedRows:
    """The rows of a batch that are not DONE yet, and the step that marks them.

    Use as a context manager: leaving the block normally marks the rows DONE, an
    exception releases them (and propagates)::

        with dedup_rows(batch, spec, key="event_id") as fresh:
            write(fresh.df)

    or call :meth:`commit` after the write succeeded and :meth:`release` if it failed.
    """

    def __init__(self, claimed: DataFrame, spec: CheckerSpec, key: str, group: str,
                 stats: DedupStats) -> None:
        self._claimed = claimed
        self._spec = spec
        self._key = key
        self._group = group
        #: One row per key not seen DONE (the original columns only).
        self.df: DataFrame = claimed.drop(_STORE_KEY, _TOKEN)
        self.stats = stats
        self.settled = False

    def commit(self) -> int:
        """Mark the rows DONE (call after the write succeeded); returns keys marked."""
        return self._settle(complete=True)

    def release(self) -> int:
        """Give the keys back after a failed write; returns keys released."""
        return self._settle(complete=False)

    def _settle(self, *, complete: bool) -> int:
        if self.settled:
            raise ConfigurationError("these rows were committed or released already")
        self.settled = True
        counter = self._claimed.sparkSession.sparkContext.accumulator(0)
        try:
            self._claimed.select(self._key, _STORE_KEY, _TOKEN).foreachPartition(
                _SettlePartition(self._spec, self._group, complete, counter)
            )
        finally:
            self._claimed.unpersist()
        return int(counter.value)

    def __enter__(self) -> DedupedRows:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.settled:
            return
        if kind is None:
            self.commit()
            return
        try:
            self.release()
        except Exception as exc:  # the write's error matters more; leases expire anyway
            log.warning("could not release dedup claims after a failed write: %r", exc)


def dedup_rows(df: DataFrame, checker_spec: CheckerSpec | Checker | str, key: str,
               *, group: str = "") -> DedupedRows:
    """Keep one row per ``key`` whose key the checker has not seen DONE.

    Args:
        df: the batch.
        checker_spec: a :class:`~msgpatterns.idempotency.CheckerSpec` of a Redis or SQL
            checker, a checker (its spec is taken; the checker itself stays on the
            driver), or a store URL.
        key: the column holding the idempotency key (str, bytes or int).
        group: the key group, as in ``@idempotent(..., group=...)``.

    Rows whose key is DONE are dropped; of several rows with one key one is kept. The
    kept keys are claimed (PROCESSING) until :meth:`DedupedRows.commit` marks them
    DONE or :meth:`DedupedRows.release` frees them. A key another owner holds is kept
    (never lost; written at least once). Crash semantics are the checker's: if the
    driver dies after the write and before ``commit``, the claims expire after the
    lease and a re-run writes those rows again - pair with
    :func:`~msgpatterns.spark.idempotent_batch` and an idempotent write.

    Runs one Spark job now (claiming, results cached); ``commit``/``release`` run one
    more. A null or empty key fails the job (``ValueError``): filter such rows first.
    """
    require("pyspark", "spark")
    spec = _spec_of(checker_spec)
    if key not in df.columns:
        raise ConfigurationError(f"the DataFrame has no column {key!r}")
    from pyspark import StorageLevel
    from pyspark.sql.types import StringType, StructField, StructType

    unique = df.dropDuplicates([key])
    context = df.sparkSession.sparkContext
    counters = (context.accumulator(0), context.accumulator(0))
    schema = StructType([*unique.schema.fields,
                         StructField(_STORE_KEY, StringType(), False),
                         StructField(_TOKEN, StringType(), True)])
    rows = unique.rdd.mapPartitions(_ClaimPartition(spec, key, group, counters))
    claimed = df.sparkSession.createDataFrame(rows, schema, verifySchema=False)
    claimed.persist(StorageLevel.MEMORY_AND_DISK)
    kept = claimed.count()  # claims now, once; the write and commit read the cache
    stats = DedupStats(kept=kept, dropped=int(counters[0].value),
                       in_progress=int(counters[1].value))
    return DedupedRows(claimed, spec, key, group, stats)


def _batch_checker(spec: CheckerSpec) -> BatchChecker:
    """This process's checker for ``spec``, with its batch claims."""
    checker = checker_for(spec)
    assert isinstance(checker, BatchChecker), checker  # redis and sql kinds only
    return checker


def _spec_of(source: CheckerSpec | Checker | str) -> CheckerSpec:
    if isinstance(source, str):
        checker = checker_from_url(source)
        spec = checker.spec()
        checker.close()
    elif isinstance(source, CheckerSpec):
        spec = source
    else:
        spec = source.spec()
    if spec.kind not in _SHARED_KINDS:
        raise ConfigurationError(
            f"dedup_rows needs a checker executors can share (Redis or SQL), not "
            f"{spec.kind!r}"
        )
    return spec
