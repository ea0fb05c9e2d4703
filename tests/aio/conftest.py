"""Async tests run under anyio's pytest plugin, on asyncio."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from async_db import async_url
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ordering_db import engine_for


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    """A sync Engine on ``sql_url``'s database (for setting up and checking)."""
    with engine_for(sql_url) as engine:
        yield engine


@pytest.fixture
async def aengine(sql_url: str) -> AsyncIterator[AsyncEngine]:
    """An AsyncEngine on ``sql_url``'s database."""
    connect_args: dict[str, Any] = {"timeout": 30} if sql_url.startswith("sqlite") else {}
    engine = create_async_engine(async_url(sql_url), connect_args=connect_args)
    try:
        yield engine
    finally:
        await engine.dispose()
