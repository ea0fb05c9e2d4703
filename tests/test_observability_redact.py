"""One redact_url for logs, reprs and errors (issue 14 item 4)."""

from __future__ import annotations

import pytest

from msgpatterns import _redact
from msgpatterns.idempotency import spec


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://app:s3cret@db.example/orders", "postgresql://app:***@db.example/orders"),
    ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
    ("nats://s3cret@nats.example:4222", "nats://***@nats.example:4222"),
    ("amqp://guest:s3cret@mq/vhost", "amqp://guest:***@mq/vhost"),
    ("rediss://u:s3cret@cache:6380/0?password=s3cret", "rediss://u:***@cache:6380/0?password=***"),
    ("kafka://broker:9092?token=s3cret", "kafka://broker:9092?token=***"),
    ("redis://:s3cret@127.0.0.1:notaport/0", "redis://:***@127.0.0.1:notaport/0"),
    ("sqlite:///tmp/x.db", "sqlite:///tmp/x.db"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
])
def test_redact_url_hides_every_kind_of_secret(url: str, shown: str) -> None:
    assert _redact.redact_url(url) == shown
    assert "s3cret" not in _redact.redact_url(url)


def test_the_specs_and_the_cli_use_the_shared_function() -> None:
    from msgpatterns import cli
    from msgpatterns.cli import _options

    assert spec.redact_url is _redact.redact_url
    assert _options.redact_url is cli.redact_url is _redact.redact_url
    assert spec.hide_password_in is _redact.hide_password_in
    assert _redact.hide_password_in("auth failed for s3cr%40t and s3cr@t",
                                    "redis://:s3cr%40t@h/0") == "auth failed for *** and ***"
