"""Control characters in logged values: one helper for every value that comes from a user.

`printable(value)` escapes C0/C1 control characters (newline, carriage return, ESC of ANSI
sequences, ...) as `\\n`, `\\r`, `\\x1b`, so a document id, title, path or question can never
forge a log line or drive a terminal. `install()` makes every string argument of every log
record pass through it (a record factory), so call sites that pass values as `%s` arguments are
covered without each having to remember; messages built by the logging call itself (format
strings, tracebacks) are left as they are.
"""

from __future__ import annotations

import logging
import threading

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_lock = threading.Lock()
_installed = False


def _escape_char(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def _breaks_lines(ch: str) -> bool:
    """C0/C1 control characters (newline, carriage return, tab, ESC, NUL, ...) and line/paragraph separators."""
    code = ord(ch)
    return code < 0x20 or 0x7F <= code <= 0x9F or code in (0x2028, 0x2029)


def _is_control(ch: str) -> bool:
    return _breaks_lines(ch) or 0xD800 <= ord(ch) <= 0xDFFF


def has_control(text: str) -> bool:
    """Whether text holds a control character or a line/paragraph separator (what an id must not)."""
    return any(map(_breaks_lines, text))


def printable(value: object) -> str:
    """str(value) with control characters (and lone surrogates) escaped; plain text is unchanged."""
    text = value if isinstance(value, str) else str(value)
    if not any(_is_control(ch) for ch in text):
        return text
    return "".join(_escape_char(ch) if _is_control(ch) else ch for ch in text)


def _escape_args(args):
    if isinstance(args, tuple):
        return tuple(printable(a) if isinstance(a, str) else a for a in args)
    if isinstance(args, dict):
        return {k: printable(v) if isinstance(v, str) else v for k, v in args.items()}
    return args


def install() -> None:
    """Escape control characters in the string arguments of every log record (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        base = logging.getLogRecordFactory()

        def factory(*args, **kwargs) -> logging.LogRecord:
            record = base(*args, **kwargs)
            if record.args:
                record.args = _escape_args(record.args)
            return record

        logging.setLogRecordFactory(factory)
        _installed = True
