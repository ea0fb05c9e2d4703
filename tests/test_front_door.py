"""The front door, as a newcomer meets it: ``from msgpatterns import AsyncConsumer``
and the async checkers beside their sync twins (loaded on first use: ``import
msgpatterns`` stays light), ``dir()`` of every lazily loaded package lists its names
before any is loaded, and ``msgpatterns --version``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import msgpatterns

REPO = Path(__file__).resolve().parents[1]

#: The packages whose names load on first use (a module ``__getattr__``).
LAZY_PACKAGES = ["msgpatterns", "msgpatterns.aio", "msgpatterns.brokers",
                 "msgpatterns.brokers.admin", "msgpatterns.brokers.kafka",
                 "msgpatterns.brokers.memory", "msgpatterns.brokers.nats",
                 "msgpatterns.brokers.rabbitmq", "msgpatterns.brokers.redis",
                 "msgpatterns.idempotency", "msgpatterns.observability",
                 "msgpatterns.ordering", "msgpatterns.spark", "msgpatterns.testing"]


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_the_async_driver_and_checkers_are_top_level_names() -> None:
    from msgpatterns import (
        AsyncConsumer,
        AsyncRedisChecker,
        AsyncSqlChecker,
        AsyncTransactionalSqlChecker,
        Consumer,
    )
    from msgpatterns.aio import AsyncConsumer as from_aio
    from msgpatterns.idempotency import AsyncRedisChecker as redis_checker
    from msgpatterns.idempotency import AsyncSqlChecker as sql_checker
    from msgpatterns.idempotency import AsyncTransactionalSqlChecker as tx_checker

    assert AsyncConsumer is from_aio and Consumer is msgpatterns.Consumer
    assert (AsyncRedisChecker, AsyncSqlChecker, AsyncTransactionalSqlChecker) == (
        redis_checker, sql_checker, tx_checker)
    assert {"AsyncConsumer", "AsyncRedisChecker", "AsyncSqlChecker",
            "AsyncTransactionalSqlChecker"} <= set(msgpatterns.__all__)


def test_import_msgpatterns_loads_no_async_part_until_one_is_used() -> None:
    loaded = _python(
        "import sys, msgpatterns; dir(msgpatterns); "
        "print(sorted(m for m in sys.modules if m.startswith(('msgpatterns.aio', "
        "'msgpatterns.idempotency.redis', 'msgpatterns.idempotency.sql', 'redis', "
        "'sqlalchemy'))))")
    assert loaded == "[]"
    used = _python("import sys, msgpatterns; msgpatterns.AsyncConsumer; "
                   "print('msgpatterns.aio.consumer' in sys.modules)")
    assert used == "True"


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_dir_of_a_lazy_package_lists_every_name_before_it_is_loaded(name: str) -> None:
    module = importlib.import_module(name)
    assert "__getattr__" in vars(module) and "__dir__" in vars(module)
    assert set(module.__all__) <= set(dir(module))
    # In a fresh process: dir() shows the lazy names and loads none of them.
    before_after = _python(
        f"import sys, {name} as m; lazy = [n for n in m.__all__ if n not in vars(m)]; "
        "before = set(sys.modules); names = dir(m); "
        "print(all(n in names for n in m.__all__), bool(lazy), "
        "sorted(set(sys.modules) - before))")
    assert before_after.startswith("True True []") or before_after == "True False []"


def test_every_lazy_package_is_listed() -> None:
    """A package that gains a lazy ``__getattr__`` joins :data:`LAZY_PACKAGES`."""
    import pkgutil

    lazy = [info.name for info in pkgutil.walk_packages(msgpatterns.__path__, "msgpatterns.")
            if info.ispkg and not any(p.startswith("_") for p in info.name.split("."))
            and "__getattr__" in vars(importlib.import_module(info.name))]
    assert sorted(["msgpatterns", *lazy]) == sorted(LAZY_PACKAGES)


def test_msgpatterns_version_prints_the_library_version() -> None:
    done = subprocess.run([sys.executable, "-m", "msgpatterns", "--version"],
                          capture_output=True, text=True, check=False, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert done.stdout == f"msgpatterns {msgpatterns.__version__}\n"
    assert msgpatterns.__version__ == project["version"]
