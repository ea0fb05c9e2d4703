"""dedup_rows: drop rows a checker has seen DONE, mark the rest DONE once written.

For sources that resend (an upstream retry, a replayed file): the same event comes back
in a later micro-batch with a new batch id, which the batch ledger cannot recognise.
A checker (Redis or SQL, the same one ``@idempotent`` consumers use) remembers the
keys whose effect was applied.

The claim happens on the executors, per partition, with one ``claim_many`` per chunk;
the outcomes are cached so the write and the marking see exactly the rows that were
claimed. Marking (``complete_many``) happens only when the caller says the write
succeeded; a failed write releases the claims so a re-run writes those rows again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.base import Checker, LeaseChecker
from msgpatterns.idempotency.records import Claim, Status
from msgpatterns.idempotency.spec import CheckerSpec, checker_from_url
from msgpatterns.spark.batch import streaming_query_id
from msgpatterns.spark.ledger import check_sink_id
from msgpatterns.spark.resources import checker_for

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

__all__ = ["DedupStats", "DedupedRows", "dedup_rows"]

log = logging.getLogger("msgpatterns.spark")

#: Keys per claim/complete round trip.
CHUNK = 1000

_STORE_KEY = "__msgpatterns_dedup_key"
_TOKEN = "__msgpatterns_dedup_token"
_STATUS = "__msgpatterns_dedup_status"
_SETTLED = "__msgpatterns_dedup_settled"
#: Checker kinds whose state other processes can see.
_SHARED_KINDS = ("redis", "sql")
#: What a claim found, per row (the statuses a row can have after ``claim_many``).
_KEPT, _HELD, _DONE = "claimed", "in_progress", "done"


@dataclass(frozen=True)
class DedupStats:
    """Counts of one :func:`dedup_rows` call (distinct keys of the batch)."""

    kept: int
    dropped: int
    in_progress: int


class _ClaimPartition:
    """``mapInArrow``: claim each key with the call's owner token and add the claim's
    store key, token (None when not ours) and outcome to the row.

    The token is the same for every task of one :func:`dedup_rows` call, so a task that
    runs again (a lost executor's cached blocks, a re-attempt, a speculative copy)
    finds its keys held by that token and gets them back ``CLAIMED``.
    """

    def __init__(self, spec: CheckerSpec, key: str, group: str, token: str) -> None:
        self.spec = spec
        self.key = key
        self.group = group
        self.token = token

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        checker = _lease_checker(self.spec)
        for batch in batches:
            for start in range(0, batch.num_rows, CHUNK):
                chunk = batch.slice(start, CHUNK)
                keys = chunk.column(self.key).to_pylist()
                claims = checker.claim_many(keys, group=self.group, token=self.token)
                yield pa.RecordBatch.from_arrays(
                    [*chunk.columns,
                     pa.array([c.key for c in claims], pa.string()),
                     pa.array([c.token for c in claims], pa.string()),
                     pa.array([_outcome(c) for c in claims], pa.string())],
                    names=[*chunk.schema.names, _STORE_KEY, _TOKEN, _STATUS],
                )


def _outcome(claim: Claim) -> str:
    if claim.status is Status.DONE:
        return _DONE
    return _KEPT if claim.claimed else _HELD  # another owner's lease: written, at least once


class _SettlePartition:
    """``mapInArrow`` over (key, store key, token): complete or release the claims and
    yield how many were settled.

    Completing also marks keys that were in progress at claim time when their lease has
    expired since; a key another owner still holds is left to that owner.
    """

    def __init__(self, spec: CheckerSpec, group: str, token: str, complete: bool) -> None:
        self.spec = spec
        self.group = group
        self.token = token
        self.complete = complete

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        checker = _lease_checker(self.spec)
        settled = 0
        for batch in batches:
            for start in range(0, batch.num_rows, CHUNK):
                keys, store_keys, tokens = (
                    column.to_pylist() for column in batch.slice(start, CHUNK).columns)
                ours = [Claim(s, Status.CLAIMED, t)
                        for s, t in zip(store_keys, tokens, strict=True) if t is not None]
                if not self.complete:
                    settled += sum(checker.release_many(ours)) if ours else 0
                    continue
                others = [k for k, t in zip(keys, tokens, strict=True) if t is None]
                if others:
                    ours += [c for c in checker.claim_many(others, group=self.group,
                                                           token=self.token) if c.claimed]
                settled += sum(checker.complete_many(ours)) if ours else 0
        yield pa.RecordBatch.from_pydict({_SETTLED: pa.array([settled], pa.int64())})


class DedupedRows:
    """The rows of a batch that are not DONE yet, and the step that marks them.

    Use as a context manager: leaving the block normally marks the rows DONE, an
    exception releases them (and propagates)::

        with dedup_rows(batch, spec, key="event_id") as fresh:
            write(fresh.df)

    or call :meth:`commit` after the write succeeded and :meth:`release` if it failed.
    """

    def __init__(self, claimed: DataFrame, spec: CheckerSpec, key: str, group: str,
                 token: str, stats: DedupStats) -> None:
        from pyspark.sql import functions as F

        self._claimed = claimed
        self._spec = spec
        self._key = key
        self._group = group
        self._token = token
        self._kept = claimed.where(F.col(_STATUS) != _DONE)
        #: One row per key not seen DONE (the original columns only).
        self.df: DataFrame = self._kept.drop(_STORE_KEY, _TOKEN, _STATUS)
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
        try:
            settle = _SettlePartition(self._spec, self._group, self._token, complete)
            settled = (self._kept.select(self._key, _STORE_KEY, _TOKEN)
                       .mapInArrow(settle, f"{_SETTLED} long").collect())
        finally:
            self._claimed.unpersist()
        return sum(int(row[0]) for row in settled)  # one row per partition

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
               *, group: str = "", sink_id: str | None = None, batch_id: int | None = None,
               query_id: str | None = None, checkpoint: str | None = None) -> DedupedRows:
    """Keep one row per ``key`` whose key the checker has not seen DONE.

    Args:
        df: the batch.
        checker_spec: a :class:`~msgpatterns.idempotency.CheckerSpec` of a Redis or SQL
            checker, a checker (its spec is taken; the checker itself stays on the
            driver), or a store URL.
        key: the column holding the idempotency key (str, bytes or int).
        group: the key group, as in ``@idempotent(..., group=...)``.
        sink_id: the sink's name (inside ``foreachBatch``, with ``batch_id``).
        batch_id: the micro-batch id: the claims then belong to this batch of this
            query, and a replay of the batch (Spark re-runs it after a driver crash)
            gets them back. Without it each call claims under a fresh owner.
        query_id: as for :func:`~msgpatterns.spark.append_rows`: the running query's
            id by default, ``""`` for a sink keyed on ``sink_id`` alone. Used with
            ``batch_id`` only.
        checkpoint: the query's ``checkpointLocation``, where Spark Connect finds the
            query id. Used with ``batch_id`` only.

    Rows whose key is DONE are dropped; of several rows with one key one is kept. The
    kept keys are claimed (PROCESSING) until :meth:`DedupedRows.commit` marks them
    DONE or :meth:`DedupedRows.release` frees them. A key another owner holds is kept
    (never lost; written at least once).

    A driver crash between the claim and ``commit``: with ``batch_id`` the claims are
    the batch's (the owner token is derived from the sink, query, batch and group), so
    the batch Spark re-runs on restart claims the same keys ``CLAIMED`` again, writes
    them through an idempotent write (:func:`~msgpatterns.spark.append_rows` skips
    partitions it committed) and marks them DONE: a later resend is dropped. Without
    ``batch_id`` the re-run finds the keys held by the dead driver's claims: it writes
    them (at least once) but cannot mark them until the lease ends, so a resend
    arriving meanwhile, or after, is written again.

    Every claim of one call is made with one owner token, so a partition Spark
    computes again (cached blocks lost with an executor, a task re-attempt or a
    speculative copy) gets the same claims back: the write sees the same rows and
    ``commit`` marks them all.

    Runs one Spark job now (claiming, results cached); ``commit``/``release`` run one
    more. Uses DataFrame and Arrow APIs only: works on classic and Spark Connect
    sessions. A null or empty key fails the job (``ValueError``): filter such rows
    first.
    """
    require("pyspark", "spark")
    spec = _spec_of(checker_spec)
    if key not in df.columns:
        raise ConfigurationError(f"the DataFrame has no column {key!r}")
    from pyspark import StorageLevel
    from pyspark.sql.types import StringType, StructField, StructType

    token = _owner_token(df, group, sink_id, batch_id, query_id, checkpoint)
    unique = df.dropDuplicates([key])
    schema = StructType([*unique.schema.fields,
                         StructField(_STORE_KEY, StringType(), True),
                         StructField(_TOKEN, StringType(), True),
                         StructField(_STATUS, StringType(), True)])
    claimed = unique.mapInArrow(_ClaimPartition(spec, key, group, token), schema)
    claimed.persist(StorageLevel.MEMORY_AND_DISK)
    # claims now, once; the write and the commit read the cache (or claim again with
    # the same token if the cache is lost)
    found = {str(row[0]): int(row[1]) for row in claimed.groupBy(_STATUS).count().collect()}
    stats = DedupStats(kept=found.get(_KEPT, 0) + found.get(_HELD, 0),
                       dropped=found.get(_DONE, 0), in_progress=found.get(_HELD, 0))
    return DedupedRows(claimed, spec, key, group, token, stats)


def _owner_token(df: DataFrame, group: str, sink_id: str | None, batch_id: int | None,
                 query_id: str | None, checkpoint: str | None) -> str:
    """The owner of every claim of one call: the batch's own token (the same on every
    run of the batch) when ``batch_id`` is given, else a fresh one."""
    if batch_id is None:
        if sink_id is not None or query_id is not None or checkpoint is not None:
            raise ConfigurationError("sink_id, query_id and checkpoint need batch_id")
        return uuid.uuid4().hex
    if not isinstance(batch_id, int) or batch_id < 0:
        raise ConfigurationError("batch_id must be the micro-batch id (an int >= 0)")
    if sink_id is None:
        raise ConfigurationError("batch_id needs sink_id (the name of the sink)")
    check_sink_id(sink_id)
    if query_id is None:
        query_id = streaming_query_id(df, checkpoint)
    identity = json.dumps(["dedup_rows", sink_id, query_id, batch_id, group])
    # 32 hex characters, as a fresh token (the stores' owner column holds 32)
    return hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()


def _lease_checker(spec: CheckerSpec) -> LeaseChecker:
    """This process's checker for ``spec``, with its batch claims."""
    checker = checker_for(spec)
    assert isinstance(checker, LeaseChecker), checker  # redis and sql kinds only
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
