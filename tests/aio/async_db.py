"""Helpers of the async tests on the real databases."""

from __future__ import annotations


def async_url(url: str) -> str:
    """The async driver's URL for one of the test databases (psycopg 3 serves both)."""
    if url.startswith("sqlite:"):
        return url.replace("sqlite:", "sqlite+aiosqlite:", 1)
    if url.startswith("mysql+pymysql:"):
        return url.replace("mysql+pymysql:", "mysql+aiomysql:", 1)
    assert url.startswith("postgresql+psycopg:"), url
    return url
