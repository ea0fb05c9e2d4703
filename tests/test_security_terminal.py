"""Issue 25 item 4: a hostile producer's text never acts on the operator's terminal.

A dead letter is stored through the real API on every broker's real server (Kafka: the
librdkafka mock cluster) with ESC/CSI/OSC (window title, OSC 52 clipboard), BEL, CR,
newline, C1 and bidi sequences in its key, body, error text and reason; then
``msgpatterns dlq list`` and ``dlq show`` run as a subprocess, as an operator runs them.
Their output must hold no control character but the newlines the command writes itself,
and no forged line (a fake "0 dead letter(s)").
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from broker_harness import Harness, drain, eventually, harness_params, make_harness
from msgpatterns import DeadLetter, Reject
from msgpatterns._escape import escape_control

pytestmark = pytest.mark.timeout(120)

#: Clear screen, cursor home, a forged summary line, a window title, a clipboard write
#: (OSC 52), a bell, a C1 CSI, a bidi override, a line separator, a lone surrogate-free
#: DEL.
HOSTILE = ("\x1b[2J\x1b[H\r\n0 dead letter(s)\n\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIC8=\x07"
           "\x9b31m\u202eevil\u2028\x7f")

#: Control characters (C0 but newline, DEL, C1) and the bidi/line-separator controls.
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                     "\u202a-\u202e\u2066-\u2069]")


@pytest.fixture(params=[p for p in harness_params() if p.id != "memory"])
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from make_harness(request.param)


def msgpatterns(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "msgpatterns", *args],
                          capture_output=True, text=True, timeout=60)


def bury_hostile(h: Harness) -> str:
    """Publish a hostile message, dead-letter its delivery with a hostile reason and
    error; its id once the admin lists it."""
    broker = h.broker()
    try:
        broker.publish(h.topic, HOSTILE.encode(), key=f"key{HOSTILE}")  # type: ignore[attr-defined]
        [message] = drain(broker, h.topic, h.group, count=1, within=20)
        record = DeadLetter.from_error(message, Reject(f"error{HOSTILE}"),
                                       now=broker.now(),  # type: ignore[attr-defined]
                                       reason=f"reason{HOSTILE}", group=h.group)
        broker.dead_letter(message, record)  # type: ignore[attr-defined]
        admin = broker.dead_letter_admin()  # type: ignore[attr-defined]
        [stored] = eventually(lambda: admin.list_dead_letters(h.topic, h.group), timeout=20)
        # stored as data (NATS headers cannot carry CR/LF: the adapter folds them)
        assert "\x1b]52;c;" in stored.reason
        assert "\x1b]52;c;" in (stored.message.key or "")
        assert stored.id is not None
        return stored.id
    finally:
        h.close(broker)


def assert_inert(output: str) -> None:
    assert not CONTROL.findall(output), output.encode("unicode_escape")[:2000]
    assert "\\x1b]52;c;" in output  # shown, escaped, for the operator to see
    assert "\\x1b[2J" in output


def test_dlq_list_and_show_escape_hostile_text(h: Harness) -> None:
    """Issue 25 item 4 (every broker): `dlq list` and `dlq show` escape every control
    character of a dead letter's key, id, body, error, reason and traceback."""
    ident = bury_hostile(h)
    where = [h.url, "--topic", h.topic, "--group", h.group]  # type: ignore[attr-defined]

    listed = msgpatterns("dlq", "list", *where)
    assert listed.returncode == 0, listed.stderr
    assert_inert(listed.stdout)
    lines = listed.stdout.splitlines()
    assert len(lines) == 2, listed.stdout  # the record's line and the count
    assert lines[-1] == "1 dead letter(s)"
    assert not [line for line in lines[:-1] if line.endswith("dead letter(s)")]

    shown = msgpatterns("dlq", "show", *where, ident)
    assert shown.returncode == 0, shown.stderr
    assert_inert(shown.stdout)
    record = DeadLetter.from_json(msgpatterns("dlq", "show", *where, ident, "--json").stdout)
    assert f"reason:        {escape_control(record.reason)}\n" in shown.stdout
    assert f"key:           {escape_control(record.message.key or '')}\n" in shown.stdout
    assert f"body:          {escape_control(HOSTILE)}\n" in shown.stdout
    # every line is the command's own: a field label, or an indented traceback line
    for line in shown.stdout.splitlines():
        assert not line or line.startswith("  ") or re.match(r"[a-z ]+:", line), line

    as_json = msgpatterns("dlq", "list", *where, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert not CONTROL.findall(as_json.stdout)
    assert DeadLetter.from_json(as_json.stdout).reason == record.reason  # exact


def test_escape_control_escapes_what_acts_on_a_terminal() -> None:
    """Issue 25 item 4: the shared escaping function, on every control class."""
    assert escape_control("plain text, é, 日本, emoji \U0001f600") == \
        "plain text, é, 日本, emoji \U0001f600"
    assert escape_control("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert escape_control("a\r\nb\tc\x00\x07\x7f\x9b") == "a\\r\\nb\\tc\\x00\\x07\\x7f\\x9b"
    assert escape_control("\u202eabc\u2066\u2028") == "\\u202eabc\\u2066\\u2028"
    assert escape_control("lone \udcff") == "lone \\udcff"
    assert escape_control("line1\r\nline2", keep_newlines=True) == "line1\\r\nline2"
    assert not CONTROL.findall(escape_control("".join(map(chr, range(0x3000)))))
