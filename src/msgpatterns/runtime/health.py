"""A consumer's health snapshot, built alike by both drivers (sans I/O).

Each driver reads its own state - under its lock (the thread driver) or on its event
loop (the asyncio driver) - and hands the figures to :func:`health_snapshot`, which
turns them into the one :class:`~msgpatterns.observability.stats.Health` shape that
:class:`~msgpatterns.observability.health.HealthServer` serves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from msgpatterns.observability.stats import Health
from msgpatterns.runtime.lifecycle import State

__all__ = ["health_snapshot", "on_loop"]

T = TypeVar("T")


def health_snapshot(*, name: str, state: State, alive: bool, held_since: Iterable[float],
                    in_flight: int, last_fetch: tuple[float, bool] | None,
                    broker: Any) -> Health:
    """The health of one consumer.

    ``alive``: every thread or task it started is alive (and, for the asyncio driver,
    its loop answered); ``held_since``: when each held message was fetched
    (``time.monotonic()``); ``last_fetch``: ``(time.time(), succeeded)`` of the last
    fetch, or None before any. ``broker_connected`` is the broker's own ``connected``
    property where its class has one (an error reading it counts as disconnected),
    else whether the last fetch succeeded."""
    oldest = min(held_since, default=None)
    connected = getattr(type(broker), "connected", None)
    broker_connected: bool | None
    if isinstance(connected, property):
        try:
            broker_connected = bool(broker.connected)
        except Exception:
            broker_connected = False
    else:
        broker_connected = None if last_fetch is None else last_fetch[1]
    return Health(
        name=name,
        running=state is State.RUNNING and alive,
        state=state.value,
        last_fetch_at=None if last_fetch is None else last_fetch[0],
        last_fetch_ok=None if last_fetch is None else last_fetch[1],
        in_flight=in_flight,
        oldest_unsettled_age=None if oldest is None else max(0.0, time.monotonic() - oldest),
        broker_connected=broker_connected,
    )


def on_loop(loop: asyncio.AbstractEventLoop | None, take: Callable[[], T],
            timeout: float) -> T | None:
    """``take()`` run on ``loop``, from any thread: at once when the caller runs on that
    loop, or when the loop is missing, closed or not running (nothing there moves the
    state ``take`` reads); else scheduled there (``call_soon_threadsafe``) while the
    caller waits up to ``timeout`` seconds. None when the loop did not answer in time
    (blocked, stopped meanwhile) or was closed meanwhile."""
    if loop is None or loop.is_closed() or not loop.is_running():
        return take()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return take()
    answer: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            answer.set_result(take())
        except BaseException as exc:
            answer.set_exception(exc)

    try:
        loop.call_soon_threadsafe(run)
        return answer.result(timeout)
    except (RuntimeError, TimeoutError):
        return None
