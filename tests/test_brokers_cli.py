"""``msgpatterns dlq list|show|replay|purge`` against each adapter's real server (Kafka:
the librdkafka mock cluster), through ``msgpatterns.cli.main``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from broker_harness import Harness, drain, eventually, make_harness
from msgpatterns import Consumer, Message, Reject
from msgpatterns import headers as h
from msgpatterns.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=[
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("kafka", marks=pytest.mark.kafka),
    pytest.param("nats", marks=pytest.mark.nats),
])
def h_(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from make_harness(request.param)


def dead_letter_two(harness: Harness) -> tuple[str, str]:
    broker = harness.broker()
    first = broker.publish(harness.topic, b"first", key="k1", headers={"trace": "t1"})
    second = broker.publish(harness.topic, b"second", key="k2")

    def handler(message: Message) -> None:
        raise Reject(f"cannot handle {message.raw_body.decode()}")

    consumer = Consumer(broker, handler, topics=[harness.topic], group=harness.group,
                        poll_timeout=0.05)
    consumer.start()
    try:
        eventually(lambda: len(harness.dead_letters(broker)) == 2, timeout=20)
    finally:
        consumer.stop(5)
    harness.close(broker)
    return first, second


def dlq(harness: Harness, *args: str) -> int:
    url: str = harness.url  # type: ignore[attr-defined]
    return main(["dlq", args[0], url, "--topic", harness.topic, "--group", harness.group,
                 *args[1:]])


def test_list_show_replay_purge(h_: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = dead_letter_two(h_)

    assert dlq(h_, "list") == 0
    out = capsys.readouterr().out
    assert first in out and second in out and "2 dead letter(s)" in out
    assert "rejected: cannot handle first" in out

    assert dlq(h_, "list", "--json") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["id"] for r in records} == {first, second}

    assert dlq(h_, "show", first) == 0
    shown = capsys.readouterr().out
    assert "body:          first" in shown and "Reject: cannot handle first" in shown
    assert "key:           k1" in shown and '"trace": "t1"' in shown
    assert dlq(h_, "show", "no-such-id") == 1
    capsys.readouterr()

    assert dlq(h_, "replay") == 2  # ids or --all, explicitly
    capsys.readouterr()
    assert dlq(h_, "replay", first) == 0
    assert "replayed 1" in capsys.readouterr().out
    broker = h_.broker()
    [back] = drain(broker, h_.topic, h_.group, count=1, within=15)
    assert (back.raw_body, back.id, back.key, back.attempt) == (b"first", first, "k1", 1)
    assert back.headers.get("trace") == "t1"
    assert h.ERROR_TYPE not in back.headers and h.FIRST_FAILED_AT not in back.headers
    broker.ack(back)
    assert [r.id for r in h_.dead_letters(broker)] == [second]  # removed once replayed

    assert dlq(h_, "purge", "--all") == 0
    assert "purged 1" in capsys.readouterr().out
    assert dlq(h_, "list") == 0
    assert "0 dead letter(s)" in capsys.readouterr().out


def test_unknown_scheme_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dlq", "list", "mqtt://host", "--topic", "t"]) == 2
    assert "unknown broker URL scheme 'mqtt'" in capsys.readouterr().err
