"""Message text made safe to show: one :func:`escape_control` for the CLI and log lines.

A message's body, key, id, headers and the reason it was dead-lettered come from its
producer, who may be hostile. Written raw to a terminal, an ``ESC`` sequence clears the
screen, moves the cursor over lines already printed, sets the window title or (OSC 52)
writes the operator's clipboard; written raw into a log, a newline forges a log line.
Every human-readable output of msgpatterns passes such text through
:func:`escape_control`; machine-readable outputs (``--json``, structured log fields)
keep it raw, as data.
"""

from __future__ import annotations

__all__ = ["escape_control"]

#: Named escapes; every other escaped character becomes ``\\xNN``/``\\uNNNN``.
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}

#: Characters that are not C0/C1 controls but still change what a reader sees: line and
#: paragraph separators (a new line for many log viewers) and the bidirectional controls
#: that reorder text ("Trojan Source").
_INVISIBLE = (
    "\u061c\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e"
    "\u2066\u2067\u2068\u2069"
)


def _escaped(char: str) -> str:
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


_TABLE: dict[int, str] = {
    code: _escaped(chr(code))
    for code in (*range(0x00, 0x20), *range(0x7F, 0xA0), *map(ord, _INVISIBLE))
}
_TABLE_KEEP_NEWLINES = {code: text for code, text in _TABLE.items() if code != ord("\n")}


def escape_control(text: object, *, keep_newlines: bool = False) -> str:
    """``str(text)`` (as ``%s`` formats it: an id, a key, an exception, None) with
    every character that could act on a terminal or a log written as a visible escape:
    C0 and C1 control characters (``ESC``, ``CSI``, ``BEL``, ``CR``, newline, tab...)
    and ``DEL`` as ``\\x1b``, ``\\r``, ``\\n``..., lone surrogates as ``\\udcNN``,
    the line/paragraph separators and bidirectional controls as ``\\uNNNN``.

    ``keep_newlines=True`` keeps ``\\n`` as a line break (for text that is multi-line by
    nature, such as a traceback; the caller indents its lines so none can pass for the
    command's own output); ``\\r`` is escaped either way.

    Printable text is returned unchanged (the same object): the check costs one
    ``str.isprintable()``. Backslashes are not doubled: the result is for reading, not
    for parsing back (``--json`` and structured log fields carry the exact text).
    Never raises (an object whose ``str()`` raises is shown by its type).
    """
    if not isinstance(text, str):
        try:
            text = str(text)
        except Exception:
            text = f"<{type(text).__qualname__} whose str() raised>"
    if text.isprintable():
        return text
    out = text.translate(_TABLE_KEEP_NEWLINES if keep_newlines else _TABLE)
    # Lone surrogates (bytes decoded with ``surrogateescape``) cannot be encoded.
    return out.encode("utf-8", "backslashreplace").decode("utf-8")
