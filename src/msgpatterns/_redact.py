"""Credentials out of everything shown: one ``redact_url`` for logs, reprs and errors.

Used by the idempotency specs and checkers, the CLI and the broker CLI alike, so a URL
is redacted the same way wherever it appears.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["hide_password_in", "hide_passwords_in", "redact_url"]

_SECRET_PARAMS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token"})
_NOT_SQL = ("redis", "rediss", "unix", "amqp", "amqps", "kafka", "nats", "tls", "http",
            "https")


def _redact_generic(url: str) -> str:
    """``url`` with the secret of its user info (``user:***@``; a lone user-info token,
    which may be a token or a password, becomes ``***@``) and its secret query
    parameters (``password=***``, ``token=***``...) replaced; never raises."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not parseable as a URL (e.g. a bad port): hide the user info
        return re.sub(r"//[^/@]*@", "//***@", url)
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(name.lower() in _SECRET_PARAMS for name, _ in pairs):
            query = urlencode([(name, "***" if name.lower() in _SECRET_PARAMS else value)
                               for name, value in pairs], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing secret: as given (urlunsplit would drop an empty netloc)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(url: str) -> str:
    """``url`` as it may be shown (reprs, logs, error messages): its password - in the
    user info or in the query string - replaced by ``***``, a lone user-info token too.

    SQLAlchemy URLs go through SQLAlchemy's own ``render_as_string(hide_password=True)``
    when they parse; broker and Redis URLs (and anything else) are redacted the same
    way by URL syntax. Never raises, never returns the password.
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme not in _NOT_SQL and "://" in url:
        try:
            from sqlalchemy.engine import make_url
        except ImportError:
            pass
        else:
            try:
                parsed = make_url(url)
            except Exception:  # unparsable: fall back to URL syntax
                pass
            else:
                if parsed.password is not None:
                    return _redact_generic(parsed.render_as_string(hide_password=True))
    return _redact_generic(url)


def hide_password_in(text: str, url: str) -> str:
    """``text`` (a client library's message about ``url``) with ``url``'s password, as
    written and decoded, replaced by ``***``."""
    try:
        password = urlsplit(url).password if "@" in url else None
    except ValueError:
        password = None
    for secret in {password, unquote(password)} if password else ():
        text = text.replace(secret, "***")
    return text


def hide_passwords_in(text: str, urls: Iterable[str]) -> str:
    """``text`` with the password of every URL in ``urls`` replaced by ``***`` (see
    :func:`hide_password_in`), and any URL of them that appears in it redacted."""
    for url in urls:
        text = hide_password_in(text.replace(url, redact_url(url)), url)
    return text
