"""One spelling of an ``amqps://`` URL's TLS files on both RabbitMQ drivers.

aio-pika (the asyncio driver) reads the CA and the client certificate from the URL's
query: ``cafile``, ``capath``, ``certfile``, ``keyfile``. pika (the thread driver)
wants them inside one ``ssl_options={'ca_certs': ...}`` literal and refuses those
names. :func:`pika_url` rewrites aio-pika's spelling into pika's, so the same URL
works on both::

    amqps://user:password@host:5671/%2F?cafile=/etc/ssl/rabbit-ca.pem

The result verifies the server's certificate against that CA and its host name
(pika checks the URL's host), as ``amqps://`` without a query verifies it against the
system's CAs. A URL that also has ``ssl_options`` is refused: one spelling per URL.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from msgpatterns.errors import ConfigurationError

__all__ = ["TLS_QUERY_NAMES", "pika_url"]

#: aio-pika's TLS query names, as pika's ``ssl_options`` keys take them.
TLS_QUERY_NAMES = ("cafile", "capath", "certfile", "keyfile")


def pika_url(url: str) -> str:
    """``url`` with aio-pika's TLS query parameters as pika's ``ssl_options`` (the URL
    unchanged when it has none)."""
    parts = urlsplit(url)
    if not parts.query:
        return url
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    tls = {name: value for name, value in pairs if name in TLS_QUERY_NAMES}
    if not tls:
        return url
    if parts.scheme != "amqps":
        raise ConfigurationError(
            f"{', '.join(sorted(tls))} given for an {parts.scheme}:// URL: use amqps:// "
            "for TLS")
    if any(name == "ssl_options" for name, _ in pairs):
        raise ConfigurationError(
            "give the TLS files either as cafile=/certfile=/keyfile= or as pika's "
            "ssl_options=, not both")
    rest = [(name, value) for name, value in pairs if name not in TLS_QUERY_NAMES]
    rest.append(("ssl_options", repr(tls)))
    return urlunsplit(parts._replace(query=urlencode(rest)))
