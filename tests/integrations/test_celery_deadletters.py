"""Celery dead letters in Redis that ``msgpatterns dlq`` lists and replays, with a real
``celery worker`` process (issue 23, item 7): the task gives up, the record is listed by
the command, replayed by the command, sent back to Celery by ``resend_replayed`` and run
once by the worker."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("celery")

import redis

from msgpatterns.integrations.celery import resend_replayed

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

HERE = Path(__file__).parent


def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.05)


def dlq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "msgpatterns", "dlq", *args],
                          capture_output=True, text=True, timeout=60, check=True)


@pytest.fixture
def state_url(redis_url: str) -> str:
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    return f"{base}/14"


class Workers:
    """``celery worker`` processes of the test app (solo pool, each its own session)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_worker_app", "worker",
             "--pool=solo", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "--loglevel=INFO", "-Q", self.env["MP_CELERY_PREFIX"]],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def workers(state_url: str, unique: str) -> Iterator[Workers]:
    env = {**os.environ, "MP_CELERY_BROKER": state_url, "MP_CELERY_STATE": state_url,
           "MP_CELERY_PREFIX": f"mp-celery-{unique}",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    group = Workers(env)
    try:
        yield group
    finally:
        group.stop_all()
        client = redis.Redis.from_url(state_url)
        prefix = env["MP_CELERY_PREFIX"]
        client.delete(*client.keys(f"{prefix}*"), *client.keys(f"_kombu.binding.{prefix}*"),
                      f"{prefix}:fixed")
        client.close()


def load_app(workers: Workers, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The worker's module, built in this process with the worker's settings."""
    for name, value in workers.env.items():
        if name.startswith("MP_CELERY_"):
            monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location(
        f"app_{workers.env['MP_CELERY_PREFIX']}", HERE / "celery_worker_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dead_letters_are_listed_and_replayed_by_the_command(
        workers: Workers, state_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tasks_module = load_app(workers, monkeypatch)
    app, ship, store = tasks_module.app, tasks_module.ship, tasks_module.store
    prefix = workers.env["MP_CELERY_PREFIX"]
    workers.start()
    topic = f"{prefix}.ship"
    client = redis.Redis.from_url(state_url)

    ship.apply_async(("o-1",), task_id="ship-1")

    def listed() -> list[dict[str, object]]:
        out = dlq("list", "--json", "--topic", topic, state_url).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    until(lambda: len(listed()) == 1)
    [record] = listed()
    assert record["id"] == "ship-1"
    assert record["group"] == "shipping"
    assert record["attempts"] == 2  # max_attempts: one Celery retry, then given up
    assert record["error_type"] == "builtins.ConnectionError"
    assert json.loads(base64.b64decode(str(record["body_b64"]))) == {
        "args": ["o-1"], "kwargs": {}}

    client.set(f"{prefix}:fixed", 1)  # the carrier is back
    assert "replayed 1 dead letter(s)" in dlq("replay", "--all", "--topic", topic,
                                               state_url).stdout
    assert listed() == []
    assert resend_replayed(ship, store) == 1
    until(lambda: client.hget(f"{prefix}:shipped", "o-1") == b"1")
    assert resend_replayed(ship, store) == 0  # nothing left behind
    client.close()
    app.close()


def test_a_worker_killed_mid_task_loses_nothing(
        workers: Workers, state_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL a worker while its task runs: kombu restores the unacked task at its
    first restore scan after visibility_timeout (4 s here, scans every second), a new
    worker runs it once the dead worker's idempotency lease (2 s) expired: applied
    exactly once, nothing dead-lettered."""
    tasks_module = load_app(workers, monkeypatch)
    prefix = workers.env["MP_CELERY_PREFIX"]
    client = redis.Redis.from_url(state_url)
    client.set(f"{prefix}:fixed", 1)  # the carrier works: only the kill gets in the way
    client.set(f"{prefix}:hold", 1)
    first = workers.start()
    tasks_module.ship.apply_async(("slow-1",), task_id="slow-1")
    until(lambda: client.exists(f"{prefix}:started:slow-1") == 1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    client.delete(f"{prefix}:hold")
    killed_at = time.monotonic()
    workers.start()
    until(lambda: client.hget(f"{prefix}:shipped", "slow-1") == b"1", timeout=90)
    restored_after = time.monotonic() - killed_at
    assert client.hget(f"{prefix}:shipped", "slow-1") == b"1"
    assert dlq("list", "--json", "--topic", f"{prefix}.ship", state_url).stdout == ""
    print(f"restored and run {restored_after:.1f}s after the kill")
    client.close()
    tasks_module.app.close()
