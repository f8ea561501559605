"""The text formatter of ``servehealth_common.logs`` keeps one record on one line: control
characters in a message (a proxy's 503 body, an agent's reason) are escaped, so no input can
write a line of its own (issue 13, point 5). A traceback stays multi-line, every line after the
first marked as a continuation, so it cannot forge a record either.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from typing import Any

import pytest

from servehealth_common.logs import (
    CONTINUATION,
    JsonFormatter,
    TextFormatter,
    escape_controls,
    setup,
)

#: How the text format begins every record: "2026-12-01 10:00:00,123 INFO logger: ...".
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")
FORGED = "\n2026-12-01 10:00:00,000 INFO node_agent: FORGED LINE \x1b[31m"
#: Every character the formatter must not write as it is.
CONTROLS = [
    *(chr(c) for c in range(0x20)),
    "\x7f",
    *(chr(c) for c in range(0x80, 0xA0)),
    "\u2028",
    "\u2029",
]


def record(message: str, *args: Any, name: str = "node_agent.probing") -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, message, args, None)


def raised(error: BaseException) -> Any:
    try:
        raise error
    except BaseException:
        return sys.exc_info()


def assert_one_record_per_line(text: str) -> list[str]:
    """Every line a record start or a marked continuation; returns the lines."""
    lines = text.split("\n")
    # Python's own idea of a line break (\r, \x0b, \x1c, \x85, \u2028, ...) agrees with "\n".
    assert text.splitlines() == lines
    assert RECORD_START.match(lines[0]), lines[0]
    for line in lines[1:]:
        assert line.startswith(CONTINUATION), line
        assert not RECORD_START.match(line)
    assert all(char not in text for char in CONTROLS if char != "\n")
    return lines


def test_a_forged_line_in_a_message_stays_in_its_record() -> None:
    body = "This node is being drained." + FORGED
    line = TextFormatter().format(record("%s: %s (HTTP %s, %s)", "proxy", "DRAINING", 503, body))
    assert assert_one_record_per_line(line) == [line]
    assert line.endswith(
        " INFO node_agent.probing: proxy: DRAINING (HTTP 503, This node is being drained."
        "\\n2026-12-01 10:00:00,000 INFO node_agent: FORGED LINE \\x1b[31m)"
    )


@pytest.mark.parametrize(
    ("char", "escaped"),
    [
        pytest.param("\n", "\\n", id="LF"),
        pytest.param("\r", "\\r", id="CR"),
        pytest.param("\t", "\\t", id="TAB"),
        pytest.param("\x00", "\\x00", id="NUL"),
        pytest.param("\x1b", "\\x1b", id="ESC"),
        pytest.param("\x0b", "\\x0b", id="VT"),
        pytest.param("\x0c", "\\x0c", id="FF"),
        pytest.param("\x1e", "\\x1e", id="RS"),
        pytest.param("\x7f", "\\x7f", id="DEL"),
        pytest.param("\x85", "\\x85", id="NEL"),
        pytest.param("\x9b", "\\x9b", id="CSI"),
        pytest.param("\u2028", "\\u2028", id="LINE-SEPARATOR"),
        pytest.param("\u2029", "\\u2029", id="PARAGRAPH-SEPARATOR"),
    ],
)
def test_every_control_character_is_escaped(char: str, escaped: str) -> None:
    assert escape_controls(f"a{char}b") == f"a{escaped}b"
    line = TextFormatter().format(record("reason: %s", f"a{char}b"))
    assert line.endswith(f"reason: a{escaped}b")
    assert_one_record_per_line(line)


def test_no_control_character_survives() -> None:
    text = "".join(CONTROLS)
    escaped = escape_controls(text)
    assert escaped.isprintable()
    assert all(char not in escaped for char in CONTROLS)


@pytest.mark.parametrize(
    "text",
    ["plain", "é 中 🙂 \u2010 — NBSP\u00a0here", "C:\\path\\n is a backslash and an n", ""],
)
def test_printable_text_is_left_as_it_is(text: str) -> None:
    assert escape_controls(text) == text


def test_the_format_itself_is_escaped_too() -> None:
    # A logger name is ours, but nothing in the line may break it: the whole first line.
    line = TextFormatter().format(record("x", name="evil\nname"))
    assert line.endswith(" INFO evil\\nname: x")


def test_a_traceback_stays_multi_line_and_cannot_forge_a_record() -> None:
    made = record("probe failed")
    made.exc_info = raised(ValueError("bad answer" + FORGED + "\rOVERWRITTEN"))
    text = TextFormatter().format(made)
    lines = assert_one_record_per_line(text)
    assert lines[0].endswith(" INFO node_agent.probing: probe failed")
    assert lines[1] == CONTINUATION + "Traceback (most recent call last):"
    assert any(line.startswith(CONTINUATION + '  File "') for line in lines)
    # The exception's own line break stays a line break, marked; the CR and ESC are escaped.
    assert lines[-2] == CONTINUATION + "ValueError: bad answer"
    assert lines[-1] == (
        CONTINUATION
        + "2026-12-01 10:00:00,000 INFO node_agent: FORGED LINE \\x1b[31m\\rOVERWRITTEN"
    )


def test_chained_tracebacks_and_stack_info_are_marked() -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as error:
            raise RuntimeError("outer") from error
    except RuntimeError:
        exc_info = sys.exc_info()
    made = record("failed")
    made.exc_info = exc_info
    made.stack_info = 'Stack (most recent call last):\n  File "x.py", line 1\nFORGED'
    lines = assert_one_record_per_line(TextFormatter().format(made))
    assert CONTINUATION + "KeyError: 'inner'" in lines
    assert CONTINUATION + "RuntimeError: outer" in lines
    assert lines[-1] == CONTINUATION + "FORGED"


def test_setup_text_uses_the_escaping_formatter() -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        setup("info", "text", stream)
        logging.getLogger("aggregator.decision.core").info("pod %s: %s", "ns/a", "up" + FORGED)
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    (line,) = stream.getvalue().splitlines()
    assert line.endswith(
        "aggregator.decision.core: pod ns/a: up\\n2026-12-01 10:00:00,000 INFO "
        "node_agent: FORGED LINE \\x1b[31m"
    )


def test_json_escapes_every_line_break_python_and_javascript_know() -> None:
    # json.dumps escapes C0 controls; with ensure_ascii=False it would leave U+2028/2029 and
    # the C1 controls (NEL among them) raw.
    text = "a" + "".join(CONTROLS) + "b"
    line = JsonFormatter().format(record("%s", text, name="x"))
    assert line.splitlines() == [line]
    assert all(char not in line for char in CONTROLS)
    assert json.loads(line)["message"] == text
