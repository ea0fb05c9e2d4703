"""Async tests run under anyio's pytest plugin, on asyncio."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from async_db import async_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def aengine(sql_url: str) -> AsyncIterator[AsyncEngine]:
    """An AsyncEngine on ``sql_url``'s database."""
    connect_args: dict[str, Any] = {"timeout": 30} if sql_url.startswith("sqlite") else {}
    engine = create_async_engine(async_url(sql_url), connect_args=connect_args)
    try:
        yield engine
    finally:
        await engine.dispose()
