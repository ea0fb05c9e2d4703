"""BatchLedger: which micro-batches a foreachBatch sink has already written.

One row per ``(sink_id, query_id, batch_id)`` in a SQL table (PostgreSQL, MySQL/
MariaDB or SQLite). Spark re-runs a batch with the same id when the driver died after
the sink's write and before the checkpoint's commit; the ledger lets the sink skip it.
The query id is part of the key because it belongs to the checkpoint: a new checkpoint
is a new query id, so batch ids starting again at 0 are never mistaken for old ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import StorePolicy
from msgpatterns.spark.resources import SqlSpec

require("sqlalchemy", "spark")

import sqlalchemy as sa  # noqa: E402

from msgpatterns import _sql  # noqa: E402

if TYPE_CHECKING:
    from sqlalchemy import Connection, Engine

__all__ = ["BatchLedger", "check_sink_id", "ledger_table"]

log = logging.getLogger("msgpatterns.spark")

T = TypeVar("T")

#: Longest sink id (it is part of the primary key).
SINK_ID_MAX = 200

#: What the ledger's batch ids are counted under: the streaming query (its checkpoint),
#: or the sink alone.
Scope = Literal["query", "sink"]
#: The query id stored for every batch of a ledger keyed on the sink alone.
SINK_SCOPE_QUERY_ID = ""


def ledger_table(name: str, metadata: sa.MetaData | None = None) -> sa.Table:
    """The ledger's table definition (primary key: sink, query, batch)."""
    return sa.Table(
        name, metadata if metadata is not None else sa.MetaData(),
        sa.Column("sink_id", sa.String(SINK_ID_MAX), primary_key=True),
        sa.Column("query_id", sa.String(64), primary_key=True),
        sa.Column("batch_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("recorded_at", sa.BigInteger, nullable=False),  # epoch milliseconds
    )


class BatchLedger:
    """The micro-batches each sink has written, in a SQL table.

    Args:
        url: an SQLAlchemy URL or ``Engine``. Put the ledger in the sink's own database
            to use :func:`~msgpatterns.spark.idempotent_batch`'s transactional mode.
        table: the ledger table's name; created on first use.
        retain: batches kept per sink and query (older rows are deleted every
            ``retain`` batches; Spark only ever re-runs its last batch). None keeps all.
        policy: retries when the database fails transiently.
        engine_options: keyword arguments for ``create_engine`` when ``url`` is a URL.
        scope: ``"query"`` (default) counts batch ids per streaming query: a new
            checkpoint is a new query id, its batches are written even where the ids
            repeat. ``"sink"`` counts them per ``sink_id`` alone (Delta's
            ``txnAppId``): a new checkpoint over input the sink already processed does
            not write it again - but a new checkpoint over *new* input whose batch ids
            restart at 0 is skipped up to the last recorded id (call :meth:`forget`
            when you reset a checkpoint on purpose). It also needs no query id, which
            a Spark Connect ``foreachBatch`` function cannot see.

    The ledger pickles (to reach a Spark Connect server with its ``foreachBatch``
    function): it travels as its URL and options and builds its engine where it is
    used; an ``Engine`` passed in travels as its URL. It never changes the
    characteristics (isolation level, autocommit) of the engine's connections: each
    read runs on a plain connection, each write in a short transaction committed at
    once, so a connection the server dropped is invalidated by SQLAlchemy as usual and
    never leaked by a reset at check-in.
    """

    def __init__(
        self,
        url: str | Engine,
        table: str = "msgpatterns_batches",
        *,
        retain: int | None = 100,
        policy: StorePolicy | None = None,
        engine_options: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        scope: Scope = "query",
    ) -> None:
        if retain is not None and retain < 1:
            raise ConfigurationError("retain must be at least 1 (or None to keep every row)")
        if scope not in ("query", "sink"):
            raise ConfigurationError('scope must be "query" or "sink"')
        self._given: Engine | None = None
        if isinstance(url, str):
            self.sql = SqlSpec.of(url, engine_options)
            self.sql.engine()  # a bad URL fails here, not at the first batch
        else:
            self._given = url
            self.sql = SqlSpec.of(url.url, engine_options)
        self.scope: Scope = scope
        self.table = ledger_table(table)
        self.retain = retain
        self.policy = policy if policy is not None else StorePolicy()
        self.clock = clock
        self._transient = _sql.transient_errors()
        self._ensure = _sql.OnFirstUse(
            lambda: self._io(lambda: _sql.create_table(self.engine, self.table), "create_table"))

    @property
    def engine(self) -> Engine:
        """The engine given, else this process's engine for the ledger's URL."""
        return self._given if self._given is not None else self.sql.engine()

    def __getstate__(self) -> dict[str, Any]:
        return {"sql": self.sql, "table": self.table.name, "retain": self.retain,
                "policy": self.policy, "clock": self.clock, "scope": self.scope}

    def __setstate__(self, state: dict[str, Any]) -> None:
        sql: SqlSpec = state["sql"]
        self.__init__(sql.url, state["table"], retain=state["retain"],  # type: ignore[misc]
                      policy=state["policy"], engine_options=sql.engine_options,
                      clock=state["clock"], scope=state["scope"])

    def query_key(self, query_id: str) -> str:
        """The query id rows are stored under: ``query_id``, or "" for scope "sink"."""
        return SINK_SCOPE_QUERY_ID if self.scope == "sink" else query_id

    # -- schema ---------------------------------------------------------------------------

    def create_table(self) -> None:
        """Create the ledger table if it is missing (done on first use anyway)."""
        self._ensure()

    # -- queries --------------------------------------------------------------------------

    def is_recorded(self, sink_id: str, query_id: str, batch_id: int) -> bool:
        """True when the sink has recorded this batch of this query."""
        self.create_table()
        match = self._match(sink_id, query_id, batch_id)

        def lookup() -> bool:
            with self.engine.connect() as conn:
                return conn.execute(sa.select(sa.literal(1)).where(match)).first() is not None

        return self._io(lookup, "is_recorded")

    def last_batch(self, sink_id: str, query_id: str) -> int | None:
        """The highest batch id recorded for this sink and query, or None."""
        self.create_table()
        c = self.table.c
        query = sa.select(sa.func.max(c.batch_id)).where(
            c.sink_id == check_sink_id(sink_id), c.query_id == query_id
        )

        def lookup() -> int | None:
            with self.engine.connect() as conn:
                found = conn.execute(query).scalar()
            return None if found is None else int(found)

        return self._io(lookup, "last_batch")

    # -- writes ---------------------------------------------------------------------------

    def record(
        self, sink_id: str, query_id: str, batch_id: int, *, conn: Connection | None = None,
    ) -> bool:
        """Record a written batch; False if it was recorded already.

        With ``conn`` the row is written inside the caller's transaction (not retried:
        the caller's transaction fails as a whole) and commits with it. A concurrent
        recorder of the same batch then waits on the key and sees it recorded.
        """
        self.create_table()
        row = {"sink_id": check_sink_id(sink_id), "query_id": query_id, "batch_id": int(batch_id),
               "recorded_at": int(self.clock() * 1000)}
        if conn is not None:
            return self._insert(conn, row)

        def insert() -> bool:
            with self.engine.begin() as own:
                return self._insert(own, row)

        return self._io(insert, "record")

    def _insert(self, conn: Connection, row: dict[str, Any]) -> bool:
        keys = [self.table.c.sink_id, self.table.c.query_id, self.table.c.batch_id]
        fresh = _sql.insert_if_absent(conn, self.table, keys, row)
        batch_id = row["batch_id"]
        if fresh and self.retain is not None and batch_id and batch_id % self.retain == 0:
            c = self.table.c
            conn.execute(sa.delete(self.table).where(
                c.sink_id == row["sink_id"], c.query_id == row["query_id"],
                c.batch_id <= batch_id - self.retain,
            ))
        return fresh

    def forget(self, sink_id: str, query_id: str | None = None) -> int:
        """Delete the sink's rows (of one query, or all); returns how many.

        Only for a sink or checkpoint that is gone for good: a running query whose
        last batch is forgotten would write that batch again if Spark re-ran it.
        """
        self.create_table()
        c = self.table.c
        stmt = sa.delete(self.table).where(c.sink_id == check_sink_id(sink_id))
        if query_id is not None:
            stmt = stmt.where(c.query_id == query_id)

        def delete() -> int:
            with self.engine.begin() as conn:
                return int(conn.execute(stmt).rowcount)

        return self._io(delete, "forget")

    def drop_table(self) -> None:
        """Drop the ledger table (tests and tear-down)."""
        self.table.drop(self.engine, checkfirst=True)
        self._ensure.reset()

    # -- helpers --------------------------------------------------------------------------

    def _match(self, sink_id: str, query_id: str, batch_id: int) -> sa.ColumnElement[bool]:
        c = self.table.c
        return sa.and_(c.sink_id == check_sink_id(sink_id), c.query_id == query_id,
                       c.batch_id == int(batch_id))

    def _io(self, fn: Callable[[], T], what: str) -> T:
        return self.policy.call(fn, self._transient, what=f"BatchLedger.{what}")

    def __repr__(self) -> str:
        scope = ", scope='sink'" if self.scope == "sink" else ""
        return f"BatchLedger({self.sql.safe_url!r}, table={self.table.name!r}{scope})"


def check_sink_id(sink_id: str) -> str:
    """``sink_id`` if it is a usable sink id, else a ConfigurationError."""
    if not isinstance(sink_id, str) or not sink_id:
        raise ConfigurationError("sink_id must be a non-empty string")
    if len(sink_id) > SINK_ID_MAX:
        raise ConfigurationError(f"sink_id is longer than {SINK_ID_MAX} characters")
    return sink_id

