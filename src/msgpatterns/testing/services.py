"""Where the real services are, and whether a test may skip when one is missing.

URLs come from environment variables with this machine's defaults. A test that needs
a service calls :func:`require`; it skips with a reason when the service is
unreachable, or fails when ``MSGPATTERNS_REQUIRE_SERVICES=1`` (as in CI).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
from urllib.parse import urlsplit

__all__ = ["SERVICES", "require", "services_required"]

SERVICES: dict[str, tuple[str, str]] = {
    # name: (environment variable, default URL)
    "redis": ("MSGPATTERNS_REDIS_URL", "redis://127.0.0.1:6379/15"),
    "postgres": ("MSGPATTERNS_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mysql": ("MSGPATTERNS_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
    "rabbitmq": ("MSGPATTERNS_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    "nats": ("MSGPATTERNS_NATS_URL", "nats://127.0.0.1:4222"),
}

_DEFAULT_PORTS = {"redis": 6379, "postgres": 5432, "mysql": 3306, "rabbitmq": 5672,
                  "nats": 4222}


def services_required() -> bool:
    """True when a missing service must fail the test run instead of skipping."""
    return os.environ.get("MSGPATTERNS_REQUIRE_SERVICES", "") not in ("", "0", "false", "no")


def url(name: str) -> str:
    """The configured URL of service ``name``."""
    env, default = SERVICES[name]
    return os.environ.get(env) or default


@functools.cache
def _reachable(name: str) -> str | None:
    """None when the service accepts TCP connections, else the reason it does not."""
    if name == "java":
        return None if shutil.which("java") or os.environ.get("JAVA_HOME") else "java not found"
    parts = urlsplit(url(name))
    host = parts.hostname or "127.0.0.1"
    port = parts.port or _DEFAULT_PORTS[name]
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return None
    except OSError as exc:
        return f"{name} unreachable at {host}:{port}: {exc}"


def require(name: str) -> str:
    """The URL of service ``name``; skip (or fail, when services are required) if it is
    unreachable."""
    import pytest

    reason = _reachable(name)
    if reason is not None:
        if services_required():
            pytest.fail(f"MSGPATTERNS_REQUIRE_SERVICES=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return url(name) if name in SERVICES else ""
