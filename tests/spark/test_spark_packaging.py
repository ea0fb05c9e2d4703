"""``msgpatterns.spark`` without its extra: importable, and each part names ``[spark]``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

WITHOUT_SPARK_EXTRA = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):  # as if pyspark and SQLAlchemy were absent
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "py4j", "sqlalchemy"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
"""


def test_the_spark_parts_name_the_extra_to_install() -> None:
    code = textwrap.dedent("""
        import msgpatterns.spark
        from msgpatterns.errors import MissingExtra
        for name in ("BatchLedger", "idempotent_batch", "upsert_latest", "dedup_rows"):
            try:
                part = getattr(msgpatterns.spark, name)
                if name == "BatchLedger":
                    part("sqlite:///x.db")
                elif name == "dedup_rows":
                    part(None, "sqlite:///x.db", "key")
            except MissingExtra as exc:
                assert "msgpatterns[spark]" in str(exc), str(exc)
                print(name, "-> spark")
            else:
                print(name, "did not raise MissingExtra")
    """)
    result = subprocess.run([sys.executable, "-c", WITHOUT_SPARK_EXTRA + code],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.splitlines() == [
        f"{name} -> spark"
        for name in ("BatchLedger", "idempotent_batch", "upsert_latest", "dedup_rows")
    ]
