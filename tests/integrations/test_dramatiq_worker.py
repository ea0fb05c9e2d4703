"""Dramatiq actors under MsgpatternsMiddleware with a real ``dramatiq`` worker process on
the real Redis and RabbitMQ brokers (issue 23, item 5): duplicates run once, retries
follow the policy with a durable attempt count, Reject and exhausted messages become
dead letters that ``msgpatterns dlq`` lists and replays (and Dramatiq's own dead-letter
queue holds), and a worker killed mid-message loses nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("dramatiq")

import redis

from msgpatterns.integrations.dramatiq import resend_replayed

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

HERE = Path(__file__).parent
APP = HERE / "dramatiq_worker_app.py"


def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.05)


def dlq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "msgpatterns", "dlq", *args],
                          capture_output=True, text=True, timeout=60, check=True)


class Setup:
    def __init__(self, broker_url: str, state_url: str) -> None:
        self.prefix = f"mp-dramatiq-{uuid.uuid4().hex[:8]}"
        self.state_url = state_url
        self.env = {**os.environ, "MP_DRAMATIQ_BROKER": broker_url,
                    "MP_DRAMATIQ_STATE": state_url, "MP_DRAMATIQ_PREFIX": self.prefix,
                    "PYTHONPATH": os.pathsep.join([str(HERE),
                                                   os.environ.get("PYTHONPATH", "")])}
        self.workers: list[subprocess.Popen[str]] = []
        self.app = self._load()
        self.state = redis.Redis.from_url(state_url)

    def _load(self) -> ModuleType:
        """The app module, built in this process with the worker's settings."""
        saved = dict(os.environ)
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("MP_")})
        try:
            spec = importlib.util.spec_from_file_location(f"app_{self.prefix}", APP)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def start_worker(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "dramatiq_worker_app", "--processes", "1",
             "--threads", "2", "--queues", self.prefix, f"{self.prefix}.DQ"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, text=True)
        self.workers.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[str]) -> None:
        """SIGKILL the worker and its forked children (no shutdown hooks run)."""
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def shipped(self, order: str) -> int:
        return int(self.state.hget(f"{self.prefix}:shipped", order) or 0)

    def listed(self) -> list[dict[str, Any]]:
        out = dlq("list", "--json", "--topic", self.prefix, self.state_url).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def cleanup(self) -> None:
        self.stop_all()
        keys = self.state.keys(f"{self.prefix}*") + self.state.keys(f"dramatiq-{self.prefix}*")
        if keys:
            self.state.delete(*keys)
        broker = self.app.broker
        if hasattr(broker, "channel"):  # RabbitMQ: delete the test's queues
            for name in (self.prefix, f"{self.prefix}.DQ", f"{self.prefix}.XQ"):
                broker.channel.queue_delete(name)
        broker.close()
        self.app.state.close()
        self.state.close()


def state_of(redis_url: str) -> str:
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    return f"{base}/14"


@pytest.fixture(params=["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def setup(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Setup]:
    from msgpatterns.testing import services

    state = state_of(redis_url)
    broker = state if request.param == "redis" else services.require("rabbitmq")
    s = Setup(broker, state)
    try:
        yield s
    finally:
        s.cleanup()


def test_retries_dead_letters_and_replay_with_a_real_worker(setup: Setup) -> None:
    ship = setup.app.ship
    setup.start_worker()
    first = ship.send("o-1")
    ship.send("o-1")  # the same order again: runs once
    ship.send("flaky-1")  # fails twice, succeeds on attempt 3
    ship.send("bad-1")  # Reject: dead-lettered at once
    broken = ship.send("broken-1")  # fails 3 times: dead-lettered
    until(lambda: setup.shipped("o-1") == 1 and setup.shipped("flaky-1") == 1
          and len(setup.listed()) == 2)
    assert first.message_id  # a real id

    records = {r["id"]: r for r in setup.listed()}
    rejected = next(r for r in records.values() if r["error_type"].endswith("Reject"))
    exhausted = records[broken.message_id]
    assert rejected["attempts"] == 1
    assert rejected["group"] == f"{setup.prefix}.ship"
    assert exhausted["attempts"] == 3  # options["retries"] carried the count
    assert exhausted["error_type"] == "builtins.ValueError"
    assert int(setup.state.get(f"{setup.prefix}:tries:flaky-1") or 0) == 3

    if not hasattr(setup.app.broker, "channel"):  # Redis: Dramatiq's own XQ has both
        xq = f"dramatiq-{setup.prefix}:{setup.prefix}.XQ"
        assert setup.state.zcard(xq) == 2

    setup.state.set(f"{setup.prefix}:fixed", 1)
    out = dlq("replay", "--topic", setup.prefix, setup.state_url, broken.message_id).stdout
    assert "replayed 1 dead letter(s)" in out
    assert resend_replayed(setup.app.broker, setup.app.store, setup.prefix) == 1
    until(lambda: setup.shipped("broken-1") == 1)
    assert [r["id"] for r in setup.listed()] == [rejected["id"]]  # the other one stays
    assert setup.shipped("o-1") == 1


def test_a_worker_killed_mid_message_loses_nothing(setup: Setup) -> None:
    setup.state.set(f"{setup.prefix}:hold", 1)
    worker = setup.start_worker()
    setup.app.ship.send("slow-1")
    until(lambda: setup.state.exists(f"{setup.prefix}:started:slow-1") == 1)
    setup.kill(worker)
    setup.state.delete(f"{setup.prefix}:hold")
    assert setup.shipped("slow-1") == 0
    setup.start_worker()
    # Redis: the dead worker's message is requeued by maintenance after heartbeat_timeout;
    # RabbitMQ: at once, when its connection closed. The dead worker's claim expires with
    # its lease (2 s) and the message runs again: applied exactly once.
    until(lambda: setup.shipped("slow-1") == 1, timeout=90)
    time.sleep(1.0)  # nothing left that would apply it a second time
    assert setup.shipped("slow-1") == 1
    assert setup.listed() == []


def test_a_broker_with_both_retries_refuses_to_boot() -> None:
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import Retries

    from msgpatterns.errors import ConfigurationError
    from msgpatterns.integrations.dramatiq import MsgpatternsMiddleware, use_msgpatterns

    both = StubBroker()
    middleware = MsgpatternsMiddleware()
    both.add_middleware(middleware)
    with pytest.raises(ConfigurationError, match="use_msgpatterns"):
        middleware.before_worker_boot(both, None)
    replaced = StubBroker()
    use_msgpatterns(replaced).before_worker_boot(replaced, None)
    assert not any(isinstance(m, Retries) for m in replaced.middleware)
