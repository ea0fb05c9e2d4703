"""SQL plumbing in one place (``msgpatterns._sql``): creating a table is safe to race
and done once per process; one dialect family and one list of transient errors for every
part that speaks SQL. (Item 6 of issue 11.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from msgpatterns._sql import OnFirstUse, create_table, family, transient_errors
from msgpatterns.errors import ConfigurationError

# -- SQL plumbing in msgpatterns._sql -----------------------------------------------


def test_create_table_is_safe_to_race_and_once_per_process(tmp_path: Path) -> None:
    """create_table reports whether it created the table; a second creator (the
    table exists) gets False, never an error; OnFirstUse runs its action once."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    table = sa.Table("t", sa.MetaData(), sa.Column("k", sa.Integer, primary_key=True))
    assert create_table(engine, table) is True
    assert create_table(engine, table) is False
    runs: list[int] = []
    once = OnFirstUse(lambda: runs.append(1))
    once()
    once()
    assert runs == [1]
    once.reset()
    once()
    assert runs == [1, 1]
    engine.dispose()


def test_dialects_and_transient_errors_come_from_one_place() -> None:
    """one family() for every SQL user, naming the part on an unknown database;
    one list of transient errors (plus the driver's own when a dialect is given)."""
    engine = sa.create_engine("sqlite://")
    assert family(engine) == "sqlite"
    assert sa.exc.OperationalError in transient_errors()
    assert engine.dialect.loaded_dbapi.OperationalError in transient_errors(engine.dialect)
    from sqlalchemy.dialects import oracle

    with pytest.raises(ConfigurationError, match="SqlSink"):
        family(oracle.dialect(), what="SqlSink")
    engine.dispose()
