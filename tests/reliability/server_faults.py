"""Faults made on the server side for the reliability tests, shared by their files:
``rabbitmqctl`` on our own connections and queues only, the ``quiet`` fixture, and the
stop/close race of a consumer and its broker."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def quiet() -> Iterator[None]:
    """msgpatterns' own log quiet while faults are made (they log by design)."""
    logger = logging.getLogger("msgpatterns")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True,
                          timeout=60, check=True).stdout


def close_rabbit_connections(name: str, reason: str = "reliability test: server-side close"
                             ) -> int:
    """``rabbitmqctl close_connection`` of the connections named ``name`` (ours only);
    how many were closed (one gone already does not count)."""
    closed = 0
    for line in rabbitmqctl("list_connections", "pid", "client_properties",
                            "--no-table-headers").splitlines():
        if f'"{name}"' not in line and f'<<"{name}">>' not in line:
            continue
        with contextlib.suppress(subprocess.CalledProcessError):  # gone already
            rabbitmqctl("close_connection", line.split("\t", 1)[0].strip(), reason)
            closed += 1
    return closed


def rabbit_queue_depth(queue: str) -> int:
    """Messages in ``queue``, ready and delivered-unacked (0 when it does not exist)."""
    for line in rabbitmqctl("list_queues", "name", "messages",
                            "--no-table-headers").splitlines():
        name, _, count = line.partition("\t")
        if name == queue:
            return int(count.strip())
    return 0


def race_stop_and_close(driver: Any, broker: Any) -> None:
    """The consumer's ``stop(5)`` and its broker's ``close()`` at the same moment: from
    two threads, or two tasks on the asyncio side (a sync ``close`` runs in a thread)."""
    if driver.is_async:
        async def both() -> None:
            closing = (broker.close() if inspect.iscoroutinefunction(broker.close)
                       else asyncio.to_thread(broker.close))
            await asyncio.gather(driver.consumer.stop(5), closing, return_exceptions=True)
        driver.call(both)
        return
    barrier = threading.Barrier(2)

    def run(fn: Callable[[], Any]) -> None:
        barrier.wait()
        with contextlib.suppress(Exception):
            fn()

    threads = [threading.Thread(target=run, args=(fn,))
               for fn in (lambda: driver.consumer.stop(5), broker.close)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
