"""Helpers for the ordering tests: an engine per database URL and throwaway tables.

Other engineers use the same database servers at the same time, so every table gets
a unique name and is dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, Text, create_engine


@contextmanager
def engine_for(url: str) -> Iterator[Engine]:
    """An engine for ``url`` that tolerates a few threads writing to SQLite at once."""
    connect_args: dict[str, Any] = {"timeout": 30} if url.startswith("sqlite") else {}
    engine = create_engine(url, connect_args=connect_args, pool_size=10)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def temp_table(engine: Engine, prefix: str, *columns: Any) -> Iterator[Table]:
    """Create a uniquely named table with ``columns``; drop it afterwards."""
    metadata = MetaData()
    table = Table(f"{prefix}_{uuid.uuid4().hex[:10]}", metadata, *columns)
    metadata.create_all(engine)
    try:
        yield table
    finally:
        metadata.drop_all(engine)


@contextmanager
def orders_table(engine: Engine, prefix: str) -> Iterator[Table]:
    """A throwaway ``(id primary key, state, version)`` table, VersionGuard's usual."""
    with temp_table(
        engine, prefix,
        Column("id", String(64), primary_key=True),
        Column("state", Text),
        Column("version", Integer),
    ) as table:
        yield table
