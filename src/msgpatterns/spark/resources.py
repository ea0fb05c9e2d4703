"""Connections rebuilt from specs, one set per process.

A Spark job ships its functions to Python workers by pickling them: live engines and
clients cannot travel. What travels is a spec - a URL and plain options - and the
receiving process builds the engine, the reflected table or the checker from it and
keeps it for the next task (PySpark reuses its Python workers). A partition then costs
one connection checkout, never one connection per row.

Nothing here imports PySpark: the driver uses the same helpers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.spec import CheckerSpec, checker_from_spec

if TYPE_CHECKING:
    from sqlalchemy import URL, Engine, Table

    from msgpatterns.idempotency.base import Checker

__all__ = ["SqlSpec", "checker_for"]

T = TypeVar("T")

#: Seconds a SQLite connection waits for another writer's lock (executors write
#: concurrently; the driver's 5 s default is too short under load).
SQLITE_BUSY_TIMEOUT = 60.0

_lock = threading.RLock()  # a build may build another cached object
_cache: dict[tuple[Any, ...], Any] = {}


def _cached(key: tuple[Any, ...], build: Callable[[], T]) -> T:
    """The object stored under ``key`` in this process, built on first use."""
    with _lock:
        if key not in _cache:
            _cache[key] = build()
        found: T = _cache[key]
        return found


def _options_key(options: Mapping[str, Any]) -> str:
    return repr(sorted(options.items(), key=lambda item: item[0]))


@dataclass(frozen=True)
class SqlSpec:
    """A picklable database connection: an SQLAlchemy URL (with credentials) and the
    keyword arguments of :func:`sqlalchemy.create_engine`.

    Every process builds one engine per distinct spec and reuses it.
    """

    url: str
    engine_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, url: str | URL, engine_options: Mapping[str, Any] | None = None) -> SqlSpec:
        """A spec for ``url`` (a string or an SQLAlchemy ``URL``)."""
        text = url if isinstance(url, str) else url.render_as_string(hide_password=False)
        if not text:
            raise ConfigurationError("a database URL is required")
        return cls(text, dict(engine_options or {}))

    @property
    def _key(self) -> tuple[str, str]:
        return self.url, _options_key(self.engine_options)

    def engine(self) -> Engine:
        """This process's engine for the spec."""
        return _cached(("engine", *self._key), self._create_engine)

    def _create_engine(self) -> Engine:
        sa = require("sqlalchemy", "sql")
        options = dict(self.engine_options)
        url = sa.engine.make_url(self.url)
        if url.get_backend_name() == "sqlite":
            if url.database in (None, "", ":memory:"):
                raise ConfigurationError(
                    "an in-memory SQLite database neither outlives the process nor reaches "
                    "Spark executors; use a SQLite file or a server URL"
                )
            connect_args = dict(options.get("connect_args", {}))
            connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT)
            options["connect_args"] = connect_args
        engine: Engine = sa.create_engine(url, **options)
        return engine

    def table(self, name: str, schema: str | None = None) -> Table:
        """The table ``name`` as the database describes it (reflected once per process)."""
        return _cached(("table", *self._key, schema, name), lambda: self._reflect(name, schema))

    def _reflect(self, name: str, schema: str | None) -> Table:
        sa = require("sqlalchemy", "sql")
        try:
            table: Table = sa.Table(name, sa.MetaData(), schema=schema,
                                    autoload_with=self.engine())
        except sa.exc.NoSuchTableError:
            where = f"{schema}.{name}" if schema else name
            raise ConfigurationError(
                f"table {where!r} does not exist in {self.safe_url}; create it first"
            ) from None
        return table

    @property
    def safe_url(self) -> str:
        """The URL without its password, for messages."""
        sa = require("sqlalchemy", "sql")
        text: str = sa.engine.make_url(self.url).render_as_string(hide_password=True)
        return text


def checker_for(spec: CheckerSpec) -> Checker:
    """This process's checker for ``spec`` (built on first use, then reused)."""
    key = ("checker", spec.kind, spec.url, _options_key(spec.options))
    return _cached(key, lambda: checker_from_spec(spec))
