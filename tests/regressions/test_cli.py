"""The ``msgpatterns`` command, run as a stranger runs it (regressions first collected
in issue 10): a subprocess (``python -m msgpatterns``) against unreachable ports, a
server that accepts and never answers, wrong passwords, bad schemes and bad options,
plus ``redis-cli`` as the foreign client that creates a topic. Each run must end with an
exit code (2 usage, 1 runtime), one line on stderr and no traceback; the subprocess
timeout (15 s) is only a generous bound on the command's own connect timeouts (5 s)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3t-Pw"


def msgpatterns(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "msgpatterns", *args],
                          capture_output=True, text=True, timeout=15)


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The single stderr line of a run that failed with ``code``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.returncode == code, result.stderr
    assert SECRET not in result.stderr
    return lines[0]


def with_credentials(url: str, user: str, password: str | None) -> str:
    parts = urlsplit(url)
    userinfo = user if password is None else f"{user}:{password}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.hostname}:{parts.port}"))


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.parametrize("args", [
    ["dlq", "list", f"redis://:{SECRET}@127.0.0.1:1/0", "--topic", "t"],
    ["dlq", "list", f"amqp://guest:{SECRET}@127.0.0.1:1/", "--topic", "t", "--group", "g"],
    ["dlq", "list", "kafka://127.0.0.1:1", "--topic", "t"],
    ["dedup", "purge", "--url", f"postgresql+psycopg://u:{SECRET}@127.0.0.1:1/test"],
    ["dedup", "purge", "--url", f"mysql+pymysql://root:{SECRET}@127.0.0.1:1/test"],
    ["demo", "--no-progress", "--db", f"postgresql+psycopg://u:{SECRET}@127.0.0.1:1/t"],
], ids=["redis", "rabbitmq", "kafka", "postgres", "mysql", "demo-db"])
def test_unreachable_server_is_one_line_exit_1(args: list[str]) -> None:
    """Hole 9: an unreachable server printed a raw traceback (redis ConnectionError,
    pika AMQPConnectionError, psycopg2 OperationalError; Kafka: 30 s and 696 lines of
    librdkafka log). Now: one line naming the redacted URL and the fix, exit 1."""
    line = one_line_error(msgpatterns(*args), 1)
    assert line.startswith("msgpatterns: cannot connect to ")
    assert "127.0.0.1:1" in line and "is the server running" in line


@pytest.mark.parametrize("scheme", ["redis", "amqp", "kafka"])
def test_a_server_that_never_answers_is_given_up_on(scheme: str, silent_port: int) -> None:
    """Hole 9: connect timeouts are bounded by default (<= 5 s per connection): a server
    that accepts and never answers ends the command with one line, exit 1 (the
    subprocess timeout of 15 s is the bound; no retry multiplies the wait)."""
    url = {"redis": f"redis://127.0.0.1:{silent_port}/0",
           "amqp": f"amqp://guest:guest@127.0.0.1:{silent_port}/",
           "kafka": f"kafka://127.0.0.1:{silent_port}"}[scheme]
    line = one_line_error(msgpatterns("dlq", "list", url, "--topic", "t", "--group", "g"), 1)
    assert line.startswith("msgpatterns: cannot connect to ")


@pytest.mark.rabbitmq
def test_wrong_rabbitmq_password_is_not_retried(rabbitmq_url: str) -> None:
    """Hole 9: pika's ProbableAuthenticationError printed a traceback after being
    retried as if transient. Now one line, exit 1, and (seen in the --debug log) no
    retry at all."""
    url = with_credentials(rabbitmq_url, "guest", SECRET)
    args = ("dlq", "list", url, "--topic", "t", "--group", "g")
    line = one_line_error(msgpatterns(*args), 1)
    assert line.startswith("msgpatterns: authentication failed at amqp://guest:***@")
    assert "check the user name and password" in line

    debug = msgpatterns("--debug", *args)
    assert debug.returncode != 0
    assert "ProbableAuthenticationError" in debug.stderr  # --debug shows the traceback
    assert "retrying (attempt" not in debug.stderr  # the reconnect log line


@pytest.mark.redis
def test_wrong_redis_password_is_one_line(redis_url: str) -> None:
    """Hole 9: a refused Redis login is one line, exit 1, the password redacted."""
    url = with_credentials(redis_url, "nouser", SECRET)
    line = one_line_error(msgpatterns("dlq", "list", url, "--topic", "t"), 1)
    assert line.startswith("msgpatterns: authentication failed at redis://nouser:***@")


@pytest.mark.postgres
def test_unknown_postgres_role_is_one_line(postgres_url: str) -> None:
    """Hole 9: psycopg2's OperationalError for an unknown role printed a traceback."""
    url = with_credentials(postgres_url, "nouser", SECRET)
    line = one_line_error(msgpatterns("dedup", "purge", "--url", url), 1)
    assert line.startswith("msgpatterns: authentication failed at postgresql")
    assert "nouser" in line


@pytest.mark.parametrize(("args", "named"), [
    (["dlq", "list", "redis://127.0.0.1:1", "--topic", "t", "--limit", "-5"], "--limit"),
    (["dlq", "list", "redis://127.0.0.1:1", "--topic", ""], "--topic"),
    (["dlq", "list", "redis://127.0.0.1:1", "--topic", "t", "--group", " "], "--group"),
    (["dlq", "list", f"mqtt://u:{SECRET}@127.0.0.1:1", "--topic", "t"], "unknown broker URL"),
    (["dlq", "list", "amqp://guest:guest@127.0.0.1:1/", "--topic", "t"], "--group"),
    (["dlq", "purge", "redis://127.0.0.1:1", "--topic", "t"], "--all"),
    (["dlq", "list", "redis://127.0.0.1:99999", "--topic", "t"], "Port"),
    (["dedup", "purge", "--url", f"nosuchdb://u:{SECRET}@127.0.0.1:1/x"], "unknown SQL"),
    (["dedup", "purge", "--url", "sqlite://", "--chunk", "0"], "--chunk"),
    (["demo", "--orders", "-1"], "--orders"),
    (["demo", "--duplicate-rate", "2"], "--duplicate-rate"),
    (["demo", "--workers", "0"], "--workers"),
    (["bench"], "bench"),
])
def test_usage_errors_are_one_line_exit_2(args: list[str], named: str) -> None:
    """Hole 9: `--limit -5` and `--topic ""` were accepted, `demo --orders -1` ended in
    "ValueError: Sample larger than population", an unknown SQL driver printed
    NoSuchModuleError's traceback, and `bench` was registered without a module. Each is
    now a usage error: one line naming the argument, exit 2, before any connection
    (the URLs point at a closed port: a connection attempt would exit 1)."""
    line = one_line_error(msgpatterns(*args), 2)
    assert "error:" in line and named in line


@pytest.mark.redis
def test_a_mistyped_topic_warns_an_empty_store_does_not(redis_url: str, unique: str) -> None:
    """Hole 9: a mistyped topic printed "0 dead letter(s)", exit 0, like an existing
    topic with no dead letters. Now it warns on stderr; a topic created by a foreign
    client (redis-cli) with an empty dead-letter store lists quietly."""
    mistyped = msgpatterns("dlq", "list", redis_url, "--topic", f"typo-{unique}")
    assert mistyped.returncode == 0
    assert "0 dead letter(s)" in mistyped.stdout
    warning = one_line_error(mistyped, 0)
    assert f"warning: no topic 'typo-{unique}'" in warning

    redis_cli = shutil.which("redis-cli")
    if redis_cli is None:
        pytest.skip("redis-cli not installed")
    topic = f"orders-{unique}"
    subprocess.run([redis_cli, "-u", redis_url, "XADD", topic, "*", "body", "x"],
                   check=True, capture_output=True, timeout=10)
    try:
        existing = msgpatterns("dlq", "list", redis_url, "--topic", topic)
        assert existing.returncode == 0, existing.stderr
        assert "0 dead letter(s)" in existing.stdout and existing.stderr == ""
    finally:
        subprocess.run([redis_cli, "-u", redis_url, "DEL", topic],
                       capture_output=True, timeout=10)


@pytest.mark.rabbitmq
def test_a_mistyped_rabbitmq_topic_warns(rabbitmq_url: str, unique: str) -> None:
    """Hole 9: the same warning on RabbitMQ (no queue for topic+group, no dead-letter
    queue), the URL's password redacted in it."""
    result = msgpatterns("dlq", "list", rabbitmq_url, "--topic", f"typo-{unique}",
                         "--group", "g")
    warning = one_line_error(result, 0)
    assert "warning: no topic" in warning and "--group" in warning
    password = urlsplit(rabbitmq_url).password
    assert password and f":{password}@" not in warning


@pytest.mark.kafka
def test_a_mistyped_kafka_topic_warns(unique: str) -> None:
    """Hole 9: the same warning on Kafka (neither the topic nor ``<topic>.DLT`` in the
    cluster's metadata); a topic that exists lists quietly."""
    from broker_harness import kafka_cluster
    from msgpatterns.brokers.kafka import KafkaBroker

    url: str = kafka_cluster().url
    broker = KafkaBroker(url)
    try:
        broker.publish(f"orders-{unique}", b"x")
    finally:
        broker.close()
    existing = msgpatterns("dlq", "list", url, "--topic", f"orders-{unique}")
    assert existing.returncode == 0 and existing.stderr == "", existing.stderr
    mistyped = msgpatterns("dlq", "list", url, "--topic", f"typo-{unique}")
    assert "0 dead letter(s)" in mistyped.stdout
    assert "warning: no topic" in one_line_error(mistyped, 0)


def test_one_mapping_for_wrapped_and_raw_client_errors() -> None:
    """Hole 9: the CLI boundary maps msgpatterns' own errors and the client libraries'
    raw ones alike (one function, no per-command try/except), masks the password in a
    client's text, and reports anything else as one "unexpected error" line."""
    import pika.exceptions
    import redis.exceptions

    from msgpatterns.cli import explain
    from msgpatterns.errors import BrokerClosed, BrokerUnavailable, ConfigurationError

    url = f"redis://u:{SECRET}@db.example:6379/0"
    raw = redis.exceptions.ConnectionError("Connection refused")
    wrapped = BrokerUnavailable("redis unreachable")
    wrapped.__cause__ = raw  # as the adapters raise it: ``from`` the client's error
    assert explain(wrapped, url) == explain(raw, url)
    code, line = explain(raw, url)
    assert code == 1 and line.startswith("cannot connect to redis://u:***@db.example:6379/0")

    auth = pika.exceptions.ProbableAuthenticationError("ACCESS_REFUSED")
    refused = BrokerUnavailable("cannot connect")
    refused.__cause__ = auth
    assert explain(refused, url)[1].startswith("authentication failed")
    assert explain(BrokerUnavailable("no cause"), None)[0] == 1
    assert explain(ConfigurationError("bad option"), url) == (2, "error: bad option")
    assert explain(BrokerClosed("closed"), url)[0] == 1
    assert explain(KeyboardInterrupt(), url)[0] == 130

    code, line = explain(RuntimeError(f"oops near {SECRET}"), url)
    assert code == 1 and line.startswith("unexpected error: RuntimeError")
    assert SECRET not in line and "--debug" in line


# -- the command and the demos outside the library (issue 11, item 7) ------------------


def test_importing_the_library_loads_no_command_demo_or_test_helper() -> None:
    """`import msgpatterns` (and the parts) never import the command, the demos
    or the test helpers."""
    code = ("import sys, msgpatterns, msgpatterns.brokers, msgpatterns.idempotency, "
            "msgpatterns.ordering; "
            "bad = [m for m in sys.modules if m.startswith(('msgpatterns.cli', "
            "'msgpatterns.demo', 'msgpatterns.testing'))]; print(bad); "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_subcommands_are_registered_explicitly() -> None:
    """the command's subcommands are the modules of msgpatterns.cli, in order."""
    from msgpatterns import cli

    assert [r.__module__ for r in cli.COMMANDS] == [
        "msgpatterns.cli.demo", "msgpatterns.cli.dedup", "msgpatterns.cli.dlq",
        "msgpatterns.cli.topic"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
