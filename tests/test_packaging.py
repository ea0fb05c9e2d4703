"""``import msgpatterns`` needs no extra; a missing extra is named in the error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_EXTRAS = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = {"redis", "fakeredis", "sqlalchemy", "pika", "confluent_kafka", "pyspark",
               "rich", "psycopg2", "psycopg", "pymysql"}
    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, Blocker())
    """
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_EXTRAS + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60,
    )


def test_core_works_without_any_extra() -> None:
    result = _run(
        """
        import msgpatterns
        from msgpatterns import Consumer, InMemoryBroker, RetryPolicy, Backoff, TimingWheel
        from msgpatterns import BatchExecutor, Flusher, OrderedExecutor, optimistic_update
        from msgpatterns import MemoryChecker, idempotent
        broker = InMemoryBroker()
        broker.publish("t", b"x")
        Consumer(broker, lambda m: None, topics=["t"], group="g").run_until_idle(timeout=10)
        assert len(broker.acked) == 1
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_missing_extra_names_what_to_install() -> None:
    result = _run(
        """
        from msgpatterns.errors import MissingExtra
        for name, extra in [("RedisChecker", "redis"), ("SqlChecker", "sql"),
                            ("VersionGuard", "sql")]:
            try:
                import msgpatterns
                getattr(msgpatterns, name)("redis://x" if extra == "redis" else "sqlite://")
            except MissingExtra as exc:
                assert f"msgpatterns[{extra}]" in str(exc), str(exc)
                print(name, "->", extra)
            else:
                raise SystemExit(f"{name} did not raise MissingExtra")
        """
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.count("->") == 3
