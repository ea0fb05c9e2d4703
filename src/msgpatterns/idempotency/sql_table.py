"""The dedup table and its dialect-correct statements (PostgreSQL, MySQL/MariaDB, SQLite).

One row per key: ``dedup_key`` (primary key), ``state`` (``P``/``D``),
``owner_token``, ``fingerprint``, ``expires_at`` (indexed) and ``updated_at``, both
milliseconds since the epoch, and ``result`` (nullable: the stored result text of a
DONE key completed with ``store_result``). Claiming is one statement that inserts the
row when the key is absent and takes over a row whose expiry has passed, and leaves a
live row untouched:

* PostgreSQL: ``INSERT ... SELECT * FROM unnest(:keys, :states, ...) ON CONFLICT
  (dedup_key) DO UPDATE SET col = CASE WHEN expires_at <= excluded.updated_at THEN
  excluded.col ELSE col END RETURNING ...``: a whole batch is one statement with one
  array parameter per column, and the rows as they stand afterwards come back in the
  same round trip;
* SQLite: the same ``ON CONFLICT`` statement over a multi-row ``VALUES``;
* MySQL/MariaDB: ``INSERT ... ON DUPLICATE KEY UPDATE`` with the same CASE (never
  ``INSERT IGNORE``, which would hide errors other than the duplicate), then a read.

Tables created by versions without the ``result`` column get it added on first use
(``ALTER TABLE ... ADD COLUMN result``, nullable: safe while other processes use the
table, and safe to race). Where that is not allowed (no ALTER privilege) the table is
used without it and results are not stored (logged once).

Keys are always bound parameters. On MySQL/MariaDB the key column is ``VARBINARY``,
so keys compare byte for byte: no case folding, no trailing-space padding.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.types import TypeDecorator, TypeEngine

from msgpatterns._sql import OnFirstUse, create_table, dialect_family, is_mysql
from msgpatterns.idempotency.records import DONE, PROCESSING, Record

__all__ = ["KEY_BYTES", "DedupTable"]

log = logging.getLogger("msgpatterns.idempotency")

#: Longest stored key, in UTF-8 bytes; longer keys are stored as their SHA-256.
KEY_BYTES = 255
_CHUNK = 500
#: Stored result text per statement, at most (a statement may hold one larger result).
_CHUNK_BYTES = 1 << 20
# expires_at last: MySQL evaluates the assignments left to right
_TAKEOVER_COLUMNS = ("state", "owner_token", "fingerprint", "result", "updated_at",
                     "expires_at")
_ARRAY_TYPES = {"dedup_key": sa.Text, "state": sa.Text, "owner_token": sa.Text,
                "fingerprint": sa.Text, "result": sa.Text, "expires_at": sa.BigInteger,
                "updated_at": sa.BigInteger}


#: (key, owner token, fingerprint, stored result text) of a claimed key.
Owned = tuple[str, str, "str | None", "str | None"]


def _chunks(items: Sequence[Owned]) -> Iterator[list[Owned]]:
    """At most ``_CHUNK`` items and about ``_CHUNK_BYTES`` of results per chunk."""
    chunk: list[Owned] = []
    size = 0
    for item in items:
        weight = len(item[3] or "")
        if chunk and (len(chunk) == _CHUNK or size + weight > _CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += weight
    if chunk:
        yield chunk


class DedupKey(TypeDecorator[str]):
    """Text keys; stored as VARBINARY on MySQL/MariaDB for exact comparison."""

    impl = sa.String
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if is_mysql(dialect):
            return dialect.type_descriptor(mysql.VARBINARY(KEY_BYTES))
        return dialect.type_descriptor(sa.String(KEY_BYTES))

    def process_bind_param(self, value: str | None, dialect: Dialect) -> Any:
        return value.encode("utf-8") if value is not None else None

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        return value.decode("utf-8") if isinstance(value, bytes) else value

    # Text needs no conversion elsewhere: no per-value call on PostgreSQL and SQLite.
    # aiomysql cannot send bytes with current PyMySQL (its bytes escaper is gone): it
    # sends the text, which MySQL turns into the same UTF-8 bytes for the VARBINARY
    # column (still compared byte for byte).
    def bind_processor(self, dialect: Dialect) -> Any:
        if is_mysql(dialect) and dialect.driver != "aiomysql":
            return super().bind_processor(dialect)
        return None

    def result_processor(self, dialect: Dialect, coltype: object) -> Any:
        return super().result_processor(dialect, coltype) if is_mysql(dialect) else None


#: The stored result text: ASCII JSON, up to MAX_RESULT_BYTES_LIMIT (8 MiB) plus a
#: marker; MEDIUMTEXT on MySQL/MariaDB, whose TEXT stops at 64 KiB.
RESULT_TYPE = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def result_column() -> sa.Column[Any]:
    return sa.Column("result", RESULT_TYPE, nullable=True)


def dedup_table(name: str, metadata: sa.MetaData, *, with_result: bool = True) -> sa.Table:
    """The table definition (shared by SqlChecker and TransactionalSqlChecker)."""
    columns: list[sa.Column[Any]] = [
        sa.Column("dedup_key", DedupKey(KEY_BYTES), primary_key=True),
        sa.Column("state", sa.String(1), nullable=False),
        sa.Column("owner_token", sa.String(32), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False, index=True),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
    ]
    if with_result:
        columns.append(result_column())
    return sa.Table(name, metadata, *columns)


class DedupTable:
    """The statements of one dedup table on one engine. Creates the table on first use."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.table = dedup_table(name, sa.MetaData())
        self.dialect = engine.dialect
        #: False when the table has no ``result`` column (an older table that could
        #: not be altered): results are then not stored.
        self.has_result = True
        self._ensure = OnFirstUse(self._create)

    # -- schema ---------------------------------------------------------------------------

    def create(self) -> None:
        """Create the table and its expiry index if missing (safe to race)."""
        self._ensure()

    @property
    def created(self) -> bool:
        """True once :meth:`create` ran in this process (until :meth:`drop`)."""
        return self._ensure.done

    def _create(self) -> None:
        if not create_table(self.engine, self.table):
            self._add_result_column()

    def _columns(self) -> set[str]:
        return {column["name"].lower() for column in sa.inspect(self.engine).get_columns(self.name)}

    def _add_result_column(self) -> None:
        """Add the nullable ``result`` column to a table created without it (older
        versions). Safe to race: a concurrent ALTER that wins is as good as ours."""
        if "result" in self._columns():
            return
        kind = RESULT_TYPE.compile(dialect=self.dialect)
        name = self.dialect.identifier_preparer.format_table(self.table)
        try:
            with self.engine.begin() as conn:
                conn.execute(sa.text(f"ALTER TABLE {name} ADD COLUMN result {kind} NULL"))
            log.info("added the result column to dedup table %s", self.name)
        except sa.exc.DBAPIError as exc:
            if "result" in self._columns():
                return  # another process added it meanwhile
            log.warning(
                "dedup table %s has no result column and it could not be added (%s); "
                "store_result cannot keep results there: run ALTER TABLE %s ADD COLUMN "
                "result %s NULL", self.name, exc.orig, name, kind)
            self.has_result = False
            self.table = dedup_table(self.name, sa.MetaData(), with_result=False)
            self.__dict__.pop("_claim_statement", None)
            self.__dict__.pop("_unnest_statements", None)

    def drop(self) -> None:
        """Drop the table (tests and tear-down)."""
        self.table.drop(self.engine, checkfirst=True)
        self._ensure.reset()

    # -- claim ----------------------------------------------------------------------------

    def claim(
        self, conn: Connection, rows: Sequence[dict[str, Any]], now: int, *, lock: bool = False,
    ) -> dict[str, Record]:
        """Insert each row (``updated_at`` = ``now``) whose key is absent or expired;
        return every key's row as it stands afterwards. ``lock``: read back with ``FOR
        UPDATE`` (inside a transaction that keeps the rows)."""
        found: dict[str, Record] = {}
        ordered = sorted(rows, key=lambda row: row["dedup_key"])  # one lock order: no deadlock
        if not self.has_result:
            ordered = [{k: v for k, v in row.items() if k != "result"} for row in ordered]
        for chunk in self._row_chunks(ordered):
            if is_mysql(self.dialect):
                conn.execute(self._claim_statement, chunk)
                query = sa.select(*self._returned).where(
                    self.table.c.dedup_key.in_([row["dedup_key"] for row in chunk]))
                result = conn.execute(query.with_for_update() if lock else query)
            elif dialect_family(self.dialect) == "postgresql":  # one statement over arrays
                statement, params = self._unnest(chunk)
                result = conn.execute(statement, params)
            else:  # one statement; SQLAlchemy sends the rows as one multi-row VALUES
                result = conn.execute(self._claim_statement, chunk)
            for key, state, token, fingerprint, expires_at, *stored in result:
                found[key] = Record(state, token, fingerprint, (expires_at - now) / 1000,
                                    stored[0] if stored else None)
        return found

    @staticmethod
    def _row_chunks(rows: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        """At most ``_CHUNK`` rows and about ``_CHUNK_BYTES`` of results per chunk."""
        start = 0
        while start < len(rows):
            end, size = start, 0
            while end < len(rows) and end - start < _CHUNK:
                size += len(rows[end].get("result") or "")
                if end > start and size > _CHUNK_BYTES:
                    break
                end += 1
            yield rows[start:end]
            start = end

    @property
    def _returned(self) -> tuple[sa.Column[Any], ...]:
        c = self.table.c
        stored = (c.result,) if self.has_result else ()
        return (c.dedup_key, c.state, c.owner_token, c.fingerprint, c.expires_at, *stored)

    def _unnest(self, chunk: Sequence[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        """The PostgreSQL claim of ``chunk`` and its parameters: one array parameter per
        column whose values differ between rows (the key, the token...), one plain
        parameter per column shared by all (the state, the expiry...), which spares the
        driver quoting a whole array of equal values."""
        first = chunk[0]
        varying = frozenset(name for name, value in first.items()
                            if any(row[name] != value for row in chunk))
        params = {name: [row[name] for row in chunk] if name in varying else value
                  for name, value in first.items()}
        statement = self._unnest_statements.get(varying)
        if statement is None:
            statement = self._unnest_statements[varying] = self._build_claim(varying)
        return statement, params

    @functools.cached_property
    def _unnest_statements(self) -> dict[frozenset[str], Any]:
        return {}

    @functools.cached_property
    def _claim_statement(self) -> Any:
        """The insert-or-take-over statement, built (and compiled) once. The incoming
        row's ``updated_at`` is the claim's "now", so the statement has no parameter
        outside its rows: an executemany (MySQL) or a multi-row VALUES (SQLite); on
        PostgreSQL see :meth:`_unnest`."""
        return self._build_claim(frozenset())

    def _build_claim(self, arrays: frozenset[str]) -> Any:
        """The claim statement; on PostgreSQL ``INSERT ... SELECT`` from ``unnest`` of
        the ``arrays`` columns, the other columns being one value for every row."""
        c = self.table.c
        if is_mysql(self.dialect):
            stmt: Any = mysql.insert(self.table)
            incoming = stmt.inserted
        elif dialect_family(self.dialect) == "postgresql":
            names = [column.name for column in c]
            unnested = [name for name in names if name in arrays]
            columns: dict[str, Any] = {
                name: sa.cast(sa.bindparam(name), _ARRAY_TYPES[name]())
                for name in names if name not in arrays}
            if unnested:
                rows = sa.func.unnest(*(
                    sa.cast(sa.bindparam(name), postgresql.ARRAY(_ARRAY_TYPES[name]))
                    for name in unnested)).table_valued(*unnested).render_derived(
                    name="incoming")
                columns.update((name, rows.c[name]) for name in unnested)
            stmt = postgresql.insert(self.table).from_select(
                names, sa.select(*(columns[name] for name in names)))
            incoming = stmt.excluded
        else:
            stmt = sqlite.insert(self.table)
            incoming = stmt.excluded
        expired = c.expires_at <= incoming.updated_at
        takeover = [(name, sa.case((expired, incoming[name]), else_=c[name]))
                    for name in _TAKEOVER_COLUMNS if name in c]
        if is_mysql(self.dialect):
            return stmt.on_duplicate_key_update(takeover)
        return stmt.on_conflict_do_update(
            index_elements=[c.dedup_key], set_=dict(takeover),
        ).returning(*self._returned)

    def owner_of(self, conn: Connection, key: str) -> str | None:
        """The owner token of ``key``'s row as ``conn`` sees it (None: no row)."""
        c = self.table.c
        token: str | None = conn.execute(
            sa.select(c.owner_token).where(c.dedup_key == key)).scalar_one_or_none()
        return token

    # -- complete / release -----------------------------------------------------------------

    def _owned_by(self, chunk: Sequence[Owned]) -> Any:
        """Rows whose (key, token) is one of ``chunk``'s pairs. Written as two IN lists,
        which every database answers from the primary key (a row-value IN is planned
        as a long OR): a token is only ever issued for one key, so a row can match a
        key of the list and a token of the list only as one of the pairs."""
        c = self.table.c
        return sa.and_(c.dedup_key.in_([key for key, _, _, _ in chunk]),
                       c.owner_token.in_([token for _, token, _, _ in chunk]))

    def complete(self, conn: Connection, items: Sequence[Owned], now: int,
                 expires_at: int) -> list[bool]:
        """Per (key, token, fingerprint, result): mark DONE until ``expires_at`` - with
        the result text, if any - if the token still owns the key, or insert it DONE if
        its row is gone (purged after its lease expired). True also when it is DONE by
        that token already: a retried call."""
        outcome: list[bool] = []
        for chunk in _chunks(items):
            values: dict[str, Any] = {"state": DONE, "expires_at": expires_at,
                                      "updated_at": now}
            results = self._results_of(chunk)
            if results:
                values["result"] = sa.case(results, value=self.table.c.dedup_key,
                                           else_=self.table.c.result)
            touched = conn.execute(sa.update(self.table).where(self._owned_by(chunk)).values(
                values)).rowcount
            if touched == len(chunk):
                outcome.extend([True] * len(chunk))
                continue
            gone = [{"dedup_key": key, "state": DONE, "owner_token": token,
                     "fingerprint": fingerprint, "result": result,
                     "expires_at": expires_at, "updated_at": now}
                    for key, token, fingerprint, result in chunk]
            found = self.claim(conn, gone, now)
            outcome.extend(found[key].token == token and found[key].state == DONE
                           for key, token, _, _ in chunk)
        return outcome

    def _results_of(self, chunk: Sequence[Owned]) -> dict[str, str]:
        """The result texts to store, by key (none when the table cannot keep them)."""
        results = {key: result for key, _, _, result in chunk if result is not None}
        if results and not self.has_result:
            log.error("%d result(s) not stored: dedup table %s has no result column",
                      len(results), self.name)
            return {}
        return results

    def store_results(self, conn: Connection, items: Sequence[Owned]) -> list[bool]:
        """Per (key, token, _, result): write the result text of the DONE row that
        token owns (inside the transaction that claimed it); True when written."""
        c = self.table.c
        outcome: list[bool] = []
        for chunk in _chunks(items):
            results = self._results_of(chunk)
            if not results:
                outcome.extend([False] * len(chunk))
                continue
            touched = conn.execute(sa.update(self.table).where(self._owned_by(chunk)).values(
                result=sa.case(results, value=c.dedup_key, else_=c.result))).rowcount
            outcome.extend([touched == len(chunk)] * len(chunk))
        return outcome

    def release(self, conn: Connection, items: Sequence[Owned]) -> list[bool]:
        """Per (key, token, _): delete the PROCESSING row if the token still owns it; True
        for the rows this call deleted."""
        c = self.table.c
        outcome: list[bool] = []
        for chunk in _chunks(items):
            pairs = [(key, token) for key, token, _, _ in chunk]
            stmt = sa.delete(self.table).where(self._owned_by(chunk), c.state == PROCESSING)
            if self.dialect.delete_returning:
                deleted = set(conn.scalars(stmt.returning(c.dedup_key)))
                outcome.extend(key in deleted for key, _ in pairs)
                continue
            touched = conn.execute(stmt).rowcount
            if touched in (0, len(chunk)):
                outcome.extend([touched > 0] * len(chunk))
                continue
            # MySQL has no DELETE ... RETURNING: a pair whose key is gone was ours
            present = set(conn.scalars(sa.select(c.dedup_key).where(
                c.dedup_key.in_([key for key, _ in pairs]))))
            outcome.extend(key not in present for key, _ in pairs)
        return outcome

    # -- purge ------------------------------------------------------------------------------

    def count_expired(self, cutoff: int) -> int:
        """Rows whose expiry is at or before ``cutoff`` (ms since the epoch)."""
        self.create()
        with self.engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(self.table).where(
                self.table.c.expires_at <= cutoff)
            return int(conn.execute(query).scalar_one())

    def purge_batches(self, cutoff: int, chunk: int) -> Iterator[int]:
        """Delete rows expired at or before ``cutoff``, ``chunk`` rows per transaction
        (short locks on a large table); yields each transaction's count."""
        self.create()
        c = self.table.c
        while True:
            with self.engine.begin() as conn:
                keys = list(conn.scalars(sa.select(c.dedup_key).where(
                    c.expires_at <= cutoff).order_by(c.expires_at).limit(chunk)))
                if not keys:
                    return
                deleted = conn.execute(sa.delete(self.table).where(
                    c.dedup_key.in_(keys), c.expires_at <= cutoff)).rowcount
            yield deleted
            if len(keys) < chunk:
                return
