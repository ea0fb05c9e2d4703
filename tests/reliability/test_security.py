"""Security properties, each stated in docs/security.md with the test that checks it.

Grep-style checks read the installed source; behavioural checks feed hostile keys,
table names and credentials through the public API.
"""

from __future__ import annotations

import ast
import hashlib
import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

import msgpatterns
from msgpatterns.errors import ConfigurationError, StoreUnavailable
from msgpatterns.idempotency import MemoryChecker, RedisChecker, SqlChecker, Status
from msgpatterns.idempotency.spec import CheckerSpec

SRC = Path(msgpatterns.__file__).parent


def sources() -> list[Path]:
    """The package's modules, listed when the test runs."""
    return sorted(SRC.rglob("*.py"))

HOSTILE_KEYS = [
    "'; DROP TABLE msgpatterns_dedup; --",
    "\" OR 1=1 --",
    "k') ON CONFLICT DO NOTHING; --",
    "]] redis.call('FLUSHALL') --[[",
    "return redis.call('DEL', KEYS[1])",
    "*", "?", "[a-z]", "{hash}tag", "a:b:c", "nul\x00inside", "\\", "%s", "%(x)s", "$1",
    "sha256:" + "0" * 64,
    "é" * 300,
]


def _calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            found.append((name, node))
    return found


def test_no_pickle_of_message_data() -> None:
    """No module imports pickle/marshal/shelve, or calls eval/exec: message bodies,
    headers and stored records are never unpickled or evaluated."""
    offenders = []
    for path in sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                if any(n.split(".")[0] in {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
                       for n in names):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
        for name, call in _calls(tree):
            if name in {"eval", "exec"} and isinstance(call.func, ast.Name):
                offenders.append(f"{path.relative_to(SRC)}:{call.lineno} {name}()")
    assert offenders == []


def _is_dynamic_text(node: ast.expr) -> bool:
    """An f-string, %-format, .format() or concatenation: text built at run time."""
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
        return True
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format")


#: Audited DDL built from SQLAlchemy's quoted identifier and compiled type (never from
#: message text): file -> the constant start of the statement.
AUDITED_DDL = {
    "idempotency/sql_table.py": "ALTER TABLE ",  # format_table(...) + RESULT_TYPE.compile()
}


def _audited(path: Path, node: ast.expr) -> bool:
    start = AUDITED_DDL.get(str(path.relative_to(SRC)))
    if start is None or not isinstance(node, ast.JoinedStr) or not node.values:
        return False
    first = node.values[0]
    return isinstance(first, ast.Constant) and str(first.value).startswith(start)


def test_no_sql_or_lua_built_from_text() -> None:
    """``text()``, ``exec_driver_sql()``, ``register_script()`` and ``script_load()``
    only ever get constant text (or one audited DDL statement built from a quoted
    identifier): SQL comes from SQLAlchemy constructs with bound parameters, Lua
    scripts are module constants with keys and values in KEYS/ARGV."""
    offenders = []
    for path in sources():
        tree = ast.parse(path.read_text(), str(path))
        for name, call in _calls(tree):
            if name in {"text", "exec_driver_sql", "register_script", "script_load"} \
                    and call.args and _is_dynamic_text(call.args[0]) \
                    and not _audited(path, call.args[0]):
                offenders.append(f"{path.relative_to(SRC)}:{call.lineno} {name}()")
    assert offenders == []


def _checkers(tmp_path: Path) -> list[object]:
    fakeredis = pytest.importorskip("fakeredis")
    return [
        MemoryChecker(),
        SqlChecker(f"sqlite:///{tmp_path / 'sec.db'}", table="sec_dedup"),
        RedisChecker(fakeredis.FakeRedis(), namespace="sec"),
    ]


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=range(len(HOSTILE_KEYS)))
def test_hostile_keys_are_data(key: str, tmp_path: Path) -> None:
    """A key with SQL, Lua, glob or hash-tag syntax is stored as data: claimed once,
    DONE afterwards, distinct from every other key, and nothing else is touched."""
    for checker in _checkers(tmp_path):
        claim = checker.claim(key, group="g")  # type: ignore[attr-defined]
        assert claim.status is Status.CLAIMED, checker
        assert checker.complete(claim)  # type: ignore[attr-defined]
        assert checker.claim(key, group="g").status is Status.DONE, checker  # type: ignore[attr-defined]
        assert checker.claim("other", group="g").status is Status.CLAIMED, checker  # type: ignore[attr-defined]
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'sec.db'}")
    with engine.connect() as conn:
        assert sa.inspect(conn).has_table("sec_dedup")
        assert conn.execute(sa.text("SELECT count(*) FROM sec_dedup")).scalar() == 2
    engine.dispose()


def test_long_keys_hashed_never_truncated(tmp_path: Path) -> None:
    """Keys past the store's limit are stored as their SHA-256, never truncated: two
    keys sharing a 10 kB prefix stay distinct, and a key spelled like a digest cannot
    impersonate one."""
    prefix = "x" * 10_000
    for checker in _checkers(tmp_path):
        a = checker.store_key(prefix + "a", "g")  # type: ignore[attr-defined]
        b = checker.store_key(prefix + "b", "g")  # type: ignore[attr-defined]
        assert a != b
        assert "sha256:" in a
        assert prefix not in a
        first = checker.claim(prefix + "a", group="g")  # type: ignore[attr-defined]
        assert checker.complete(first)  # type: ignore[attr-defined]
        assert checker.claim(prefix + "b", group="g").status is Status.CLAIMED  # type: ignore[attr-defined]
        digest = hashlib.sha256((prefix + "a").encode()).hexdigest()
        impostor = checker.claim(f"sha256:{digest}", group="g")  # type: ignore[attr-defined]
        assert impostor.status is Status.CLAIMED


@pytest.mark.parametrize("name", ['x"; DROP TABLE victim; --', "x'; DROP TABLE victim; --",
                                  "victim --", "a b"])
def test_hostile_table_names_refused_or_quoted(name: str, tmp_path: Path) -> None:
    """A table name is never pasted into SQL: it is refused at construction
    (ConfigurationError) or used as one quoted identifier; other tables survive."""
    url = f"sqlite:///{tmp_path / 'tables.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE victim (id INTEGER)"))
    try:
        checker = SqlChecker(engine, table=name)
    except ConfigurationError:
        pass
    else:
        claim = checker.claim("k")
        assert checker.complete(claim)
        assert checker.claim("k").status is Status.DONE
    with engine.connect() as conn:
        assert sa.inspect(conn).has_table("victim")
    engine.dispose()


SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize("url", [
    f"postgresql+psycopg2://app:{SECRET}@db.invalid:5432/shop",
    f"redis://:{SECRET}@cache.invalid:6379/0",
    f"amqp://guest:{SECRET}@mq.invalid:5672/%2F",
])
def test_credentials_redacted_in_spec_repr(url: str) -> None:
    """A checker spec's repr and str never show the password (the URL keeps it)."""
    spec = CheckerSpec("sql", url, {})
    assert SECRET not in repr(spec)
    assert SECRET not in str(spec)
    assert spec.url == url


def test_credentials_redacted_in_checker_errors_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A checker that cannot reach its store never shows the URL's password in the
    error, in its repr or in the log."""
    url = f"redis://:{SECRET}@127.0.0.1:1/0"
    caplog.set_level(logging.DEBUG, logger="msgpatterns")
    checker = RedisChecker(url, namespace="sec")
    assert SECRET not in repr(checker)
    with pytest.raises(StoreUnavailable) as info:
        checker.claim("k")
    text = "".join(str(e) for e in _chain(info.value))
    assert SECRET not in text
    assert SECRET not in caplog.text
    assert SECRET not in repr(checker.spec())
    checker.close()


def _chain(error: BaseException | None) -> list[BaseException]:
    out = []
    while error is not None and len(out) < 10:
        out.append(error)
        error = error.__cause__ or error.__context__
    return out
