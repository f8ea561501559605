"""Logging for both programs: human-readable lines, or one JSON object per line.

``--log-format json`` is for log pipelines: every record becomes ``{"time", "level", "logger",
"message"}``, plus the structured fields the call site gave with ``extra=`` (a transition's
``pod``, ``old``, ``new``, ``source``, ``reason``, ``label``), plus ``exception`` when there is
a traceback. Records of libraries (grpc, aiohttp, kubernetes) go the same way.

No input can forge a record. Messages carry text from outside (a proxy's 503 body, an agent's
reason, a pod name from the API), so neither format writes a control character as it is:

- ``text`` (:class:`TextFormatter`): the record's line (time, level, logger and message) has
  every C0 control (LF, CR, TAB, ESC ...), DEL, every C1 control (NEL ...) and U+2028/U+2029
  escaped as ``\\n``, ``\\r``, ``\\t``, ``\\xNN`` or ``\\uNNNN``
  (:func:`escape_controls`). Backslashes are not doubled: the escaped line is for people to
  read and cannot break a line, but a literal ``\\n`` in the input reads the same as an escaped
  line break (``json`` is the format that keeps the exact text).
- A traceback (``exc_info``) or ``stack_info`` stays multi-line, so that it reads as Python
  prints it, but every one of its lines is prefixed with :data:`CONTINUATION` and escaped the
  same way (only its own line breaks are kept). An exception's message is input too (a line
  break in it would otherwise start a line at column 0): with the prefix, a line of the text
  log begins a record if and only if it does not begin with whitespace, and every such line was
  written by this formatter.
- ``json``: ``json.dumps`` escapes C0 controls; DEL, the C1 controls and U+2028/U+2029 (line
  breaks to Python's ``splitlines`` and to JavaScript) are escaped as ``\\uNNNN`` too.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The prefix of every line of a traceback in the text format.
CONTINUATION = "  | "

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}

_CONTROLS = [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]
_TEXT_ESCAPES = {
    code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" for code in _CONTROLS
} | {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}
# Inside a JSON string (the only place json.dumps leaves them raw), a \uNNNN escape is valid.
_JSON_ESCAPES = {code: f"\\u{code:04x}" for code in _CONTROLS if code >= 0x7F}


def escape_controls(text: str) -> str:
    """``text`` with every control character and line separator escaped: one line, no escape
    sequences for a terminal. Printable text (any language, emoji) is left as it is."""
    if text.isprintable():  # the usual case, checked in C; every escaped character fails it
        return text
    return text.translate(_TEXT_ESCAPES)


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` lines that input cannot break (see the module's docstring)."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = escape_controls(self.formatMessage(record))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)  # cached, as logging does
        blocks = [record.exc_text] if record.exc_text else []
        if record.stack_info:
            blocks.append(self.formatStack(record.stack_info))
        for block in blocks:
            for part in block.rstrip("\n").split("\n"):
                line += f"\n{CONTINUATION}{escape_controls(part)}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in data:
                data[key] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack"] = self.formatStack(record.stack_info)
        line = json.dumps(data, ensure_ascii=False, default=str)
        return line if line.isprintable() else line.translate(_JSON_ESCAPES)


def setup(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Configure the root logger once, for a whole program (the CLIs call this)."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # urllib3 (under the kubernetes client) logs a WARNING for each of its own connection
    # retries: three lines per failed Kubernetes API call while the API server is unreachable.
    # Our callers log the failure those retries end in, once per condition; the per-retry lines
    # are shown only at debug level.
    quiet = root.getEffectiveLevel() > logging.DEBUG
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR if quiet else logging.NOTSET)
