"""Logging for both programs: human-readable lines, or one JSON object per line.

``--log-format json`` is for log pipelines: every record becomes ``{"time", "level", "logger",
"message"}``, plus the structured fields the call site gave with ``extra=`` (a transition's
``pod``, ``old``, ``new``, ``source``, ``reason``, ``label``), plus ``exception`` when there is
a traceback. Records of libraries (grpc, aiohttp, kubernetes) go the same way.
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

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


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
        return json.dumps(data, ensure_ascii=False, default=str)


def setup(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Configure the root logger once, for a whole program (the CLIs call this)."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
