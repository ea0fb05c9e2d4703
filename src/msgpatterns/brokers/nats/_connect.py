"""Opening a nats-py connection for :class:`~msgpatterns.brokers.NatsJetStreamBroker`.

Guarantees:

* :func:`open_connection` returns a connected client or raises
  :class:`~msgpatterns.errors.BrokerUnavailable` within ``timeout`` seconds, whatever
  the servers do (refuse, never answer, answer slowly). Nothing it started is left
  running: the connect task is cancelled and awaited, the half-open client closed.
  Retries while connecting are silent; the error names the last failure.
* A failure that a retry cannot mend - a TLS handshake or certificate error, refused
  credentials (``Authorization Violation``), a server that does not offer TLS when TLS
  is wanted - ends the attempt at once, and the error names it
  (``SSLCertVerificationError: ...``).
* TLS is wanted when a server URL is ``tls://`` or a TLS context or CA file is given.
  Then the session is TLS or there is no session: a server whose INFO does not require
  TLS (a plaintext server, or a man in the middle stripping TLS) is refused before
  the client sends CONNECT, so credentials and messages never cross in plaintext.
  nats-py alone would carry on in plaintext (it upgrades only when the server asks).
* Every text shown (errors, logs) has the URLs' passwords redacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client

from msgpatterns._redact import hide_passwords_in, redact_url
from msgpatterns.errors import BrokerUnavailable, ConfigurationError, describe

__all__ = ["TlsNotOffered", "open_connection", "tls_settings", "where"]


class TlsNotOffered(nats.errors.Error):
    """TLS is wanted but the server's INFO does not require it (plaintext server, or
    TLS stripped on the way): refused before anything is sent."""

    def __str__(self) -> str:
        return ("the server did not offer TLS (its INFO has no tls_required); refusing "
                "to connect in plaintext (a plaintext server, or TLS stripped on the way)")


class _TlsGuardedClient(Client):
    """nats-py's client that, when TLS is wanted, refuses a server that does not
    require TLS: checked on the INFO of every (re)connection, before CONNECT."""

    def __init__(self, wants_tls: bool) -> None:
        super().__init__()
        self._msgpatterns_wants_tls = wants_tls

    async def _process_info(self, info: dict[str, Any],
                            initial_connection: bool = False) -> None:
        if (initial_connection and self._msgpatterns_wants_tls
                and not info.get("tls_required")):
            raise TlsNotOffered()
        await super()._process_info(info, initial_connection)


def where(servers: Sequence[str]) -> str:
    """The servers as they may be shown: comma-separated, passwords redacted."""
    return ",".join(redact_url(s) for s in servers)


def tls_settings(servers: Sequence[str], tls_context: ssl.SSLContext | None,
                 tls_ca_file: str | None) -> ssl.SSLContext | None:
    """The SSL context to connect with, or None for plaintext: ``tls_context`` as
    given, else a verifying default context (trusting ``tls_ca_file`` when given) when
    TLS is wanted (a ``tls://`` URL or a CA file)."""
    if tls_context is not None and tls_ca_file is not None:
        raise ConfigurationError("give tls_context or tls_ca_file, not both (load the "
                                 "CA into the context: context.load_verify_locations())")
    if tls_context is not None and not isinstance(tls_context, ssl.SSLContext):
        raise ConfigurationError(f"tls_context must be an ssl.SSLContext, got "
                                 f"{type(tls_context).__name__}")
    if tls_context is not None:
        return tls_context
    wants = tls_ca_file is not None or any(
        urlsplit(s).scheme.lower() == "tls" for s in servers)
    if not wants:
        return None
    try:
        return ssl.create_default_context(cafile=tls_ca_file)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot load the CA file {tls_ca_file!r}: {exc}") from exc


#: What the server's ``-ERR`` says when credentials are refused (nats-py raises them
#: as a plain ``nats.errors.Error`` while connecting).
_AUTH_REFUSED = ("authorization violation", "authentication expired",
                 "authentication revoked")


def _permanent(error: BaseException) -> bool:
    """A connect failure that retrying within the timeout would not mend: TLS, or
    credentials the server refused (never retried as transient)."""
    if isinstance(error, ssl.SSLError | TlsNotOffered | nats.errors.AuthorizationError):
        return True
    return isinstance(error, nats.errors.Error) and any(
        refused in str(error).lower() for refused in _AUTH_REFUSED)


async def open_connection(
    servers: Sequence[str], *, name: str, timeout: float, tls: ssl.SSLContext | None,
    on_error: Callable[[Exception], Awaitable[None]],
    on_disconnect: Callable[[], Awaitable[None]],
) -> Any:
    """A connected nats-py client (reconnecting for ever once connected), or
    BrokerUnavailable within ``timeout`` seconds (see the module docstring)."""
    loop = asyncio.get_running_loop()
    fatal: asyncio.Future[BaseException] = loop.create_future()
    last: list[BaseException] = []
    connected = False

    async def error_cb(error: Exception) -> None:
        if connected:
            await on_error(error)
            return
        last[:] = [error]  # silent while connecting: the final error names it
        if _permanent(error) and not fatal.done():
            fatal.set_result(error)

    async def disconnected_cb() -> None:
        if connected:
            await on_disconnect()

    client = _TlsGuardedClient(wants_tls=tls is not None)
    options: dict[str, Any] = {"tls": tls} if tls is not None else {}
    # nats-py's int-typed options take seconds as float at run time.
    per_attempt: Any = timeout
    backoff: Any = 0.5
    task: asyncio.Future[None] = asyncio.ensure_future(client.connect(
        servers=list(servers), name=name, connect_timeout=per_attempt,
        allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=backoff,
        error_cb=error_cb, disconnected_cb=disconnected_cb, **options,
    ))
    waited: set[asyncio.Future[Any]] = {task, fatal}
    try:
        await asyncio.wait(waited, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if task.done() and not task.cancelled() and task.exception() is None:
        connected = True
        fatal.cancel()
        return client
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 1.0)
    cause: BaseException | None = fatal.result() if fatal.done() else None
    if cause is None and not task.cancelled() and task.exception() is not None:
        cause = task.exception()
    if cause is None and last:
        cause = last[0]
    why = (f"{type(cause).__name__}: {describe(cause)}" if cause is not None
           else "no answer")
    when = "" if fatal.done() else f" within {timeout:g} s"
    raise BrokerUnavailable(hide_passwords_in(
        f"cannot connect to NATS at {where(servers)}{when}: {why}", servers))
