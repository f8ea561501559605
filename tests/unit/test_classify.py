"""The classification table of ``servehealth_common.classify``: what each proxy answer means.

Pure functions, no I/O: every row of the table in the module docstring, plus the reason
truncation rules (at most 256 bytes of UTF-8, never a split character). The README's state
table says what the code does: each of its rows about an HTTP answer, with answers it covers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from servehealth_common import classify
from servehealth_common.classify import (
    REASON_MAX_BYTES,
    Verdict,
    classify_healthz,
    classify_routes,
    truncate_reason,
)
from servehealth_common.states import ServeState

DRAINING = "This node is being drained."
NOT_POPULATED = "Route table is not populated yet."
NO_REPLICAS = "No replicas are available yet."
EMPTY_ROUTES = "No applications are deployed (empty route table)."
FORGED = "\n2026-12-01 10:00:00,000 INFO node_agent: FORGED LINE \x1b[31m"


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        pytest.param(200, "success", Verdict(ServeState.SERVING, "success"), id="200-success"),
        pytest.param(
            200, "success\n", Verdict(ServeState.SERVING, "success"), id="200-success-newline"
        ),
        pytest.param(
            200, "  success  ", Verdict(ServeState.SERVING, "success"), id="200-success-padded"
        ),
        pytest.param(503, DRAINING, Verdict(ServeState.DRAINING, DRAINING), id="503-draining"),
        pytest.param(
            503, DRAINING + "\n", Verdict(ServeState.DRAINING, DRAINING), id="503-draining-newline"
        ),
        # The first line of a 503's body decides (issue 13): what follows it cannot hide a
        # drain. The reason is still the whole body (cut), for the operator to read.
        pytest.param(
            503, DRAINING + FORGED, Verdict(ServeState.DRAINING, DRAINING + FORGED), id="503-forged"
        ),
        pytest.param(
            503,
            f"{DRAINING}\r\nVia: gateway\r\n",
            Verdict(ServeState.DRAINING, f"{DRAINING}\r\nVia: gateway"),
            id="503-draining-crlf-more-lines",
        ),
        pytest.param(
            503,
            f"  {DRAINING}  \n\n",
            Verdict(ServeState.DRAINING, DRAINING),
            id="503-draining-padded",
        ),
        pytest.param(
            503,
            f"{NOT_POPULATED}\n{DRAINING}",
            Verdict(ServeState.NOT_READY, f"{NOT_POPULATED}\n{DRAINING}"),
            id="503-drained-on-second-line",
        ),
        pytest.param(
            503,
            f"{DRAINING} Soon.",
            Verdict(ServeState.NOT_READY, f"{DRAINING} Soon."),
            id="503-draining-with-more-on-its-line",
        ),
        pytest.param(
            503, NOT_POPULATED, Verdict(ServeState.NOT_READY, NOT_POPULATED), id="503-not-populated"
        ),
        pytest.param(
            503, NO_REPLICAS, Verdict(ServeState.NOT_READY, NO_REPLICAS), id="503-no-replicas"
        ),
        pytest.param(
            503,
            "<html><body>upstream connect error</body></html>",
            Verdict(ServeState.NOT_READY, "<html><body>upstream connect error</body></html>"),
            id="503-unknown-body",
        ),
        pytest.param(
            503,
            "Service Unavailable",
            Verdict(ServeState.NOT_READY, "Service Unavailable (HAProxy: no backend is up)."),
            id="503-haproxy-no-backend",
        ),
        pytest.param(503, "", Verdict(ServeState.NOT_READY, "HTTP 503"), id="503-empty-body"),
        pytest.param(503, "  \n", Verdict(ServeState.NOT_READY, "HTTP 503"), id="503-blank-body"),
        pytest.param(
            200, "Success", Verdict(ServeState.UNHEALTHY, "HTTP 200: Success"), id="200-wrong-case"
        ),
        pytest.param(200, "ok", Verdict(ServeState.UNHEALTHY, "HTTP 200: ok"), id="200-other"),
        # A healthy verdict needs Ray's exact answer: more lines after it are not "success".
        pytest.param(
            200,
            "success\nmore",
            Verdict(ServeState.UNHEALTHY, "HTTP 200: success\nmore"),
            id="200-success-then-more-lines",
        ),
        pytest.param(200, "", Verdict(ServeState.UNHEALTHY, "HTTP 200:"), id="200-empty"),
        pytest.param(
            500, "boom", Verdict(ServeState.UNHEALTHY, "HTTP 500: boom"), id="500-internal-error"
        ),
        pytest.param(
            500, "success", Verdict(ServeState.UNHEALTHY, "HTTP 500: success"), id="500-success"
        ),
        pytest.param(404, "nope", Verdict(ServeState.UNHEALTHY, "HTTP 404: nope"), id="404"),
        pytest.param(
            502, DRAINING, Verdict(ServeState.UNHEALTHY, f"HTTP 502: {DRAINING}"), id="502-draining"
        ),
        pytest.param(
            301, "", Verdict(ServeState.UNHEALTHY, "HTTP 301:"), id="301-redirect-not-followed"
        ),
    ],
)
def test_classify_healthz(status: int, body: str, expected: Verdict) -> None:
    assert classify_healthz(status, body) == expected


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        pytest.param(
            200, '{"/": "app"}', Verdict(ServeState.SERVING, "success"), id="200-one-route"
        ),
        pytest.param(
            200,
            '{"/a": "app1", "/b": "app2"}',
            Verdict(ServeState.SERVING, "success"),
            id="200-two-routes",
        ),
        pytest.param(200, "{}", Verdict(ServeState.NOT_READY, EMPTY_ROUTES), id="200-empty-table"),
        pytest.param(
            200, " {}\n", Verdict(ServeState.NOT_READY, EMPTY_ROUTES), id="200-empty-table-padded"
        ),
        pytest.param(
            200,
            "<html>",
            Verdict(ServeState.UNHEALTHY, "/-/routes is not JSON: <html>"),
            id="200-not-json",
        ),
        pytest.param(
            200, "", Verdict(ServeState.UNHEALTHY, "/-/routes is not JSON:"), id="200-empty-body"
        ),
        pytest.param(503, DRAINING, Verdict(ServeState.DRAINING, DRAINING), id="503-draining"),
        pytest.param(
            503, DRAINING + FORGED, Verdict(ServeState.DRAINING, DRAINING + FORGED), id="503-forged"
        ),
        pytest.param(
            503, NOT_POPULATED, Verdict(ServeState.NOT_READY, NOT_POPULATED), id="503-not-populated"
        ),
        pytest.param(503, "", Verdict(ServeState.NOT_READY, "HTTP 503"), id="503-empty"),
        pytest.param(500, "boom", Verdict(ServeState.UNHEALTHY, "HTTP 500: boom"), id="500"),
        pytest.param(404, "", Verdict(ServeState.UNHEALTHY, "HTTP 404:"), id="404"),
    ],
)
def test_classify_routes(status: int, body: str, expected: Verdict) -> None:
    assert classify_routes(status, body) == expected


def test_transport_verdicts() -> None:
    assert classify.connection_refused() == Verdict(
        ServeState.NO_PROXY, "Connection refused: no Serve proxy is listening."
    )
    assert classify.timed_out(0.2) == Verdict(ServeState.UNHEALTHY, "No answer within 200 ms.")
    assert classify.timed_out(1.5) == Verdict(ServeState.UNHEALTHY, "No answer within 1500 ms.")
    assert classify.transport_error(OSError("reset by peer")) == Verdict(
        ServeState.UNHEALTHY, "Probe failed: reset by peer"
    )
    # An exception without a message is named by its type.
    assert classify.transport_error(ConnectionResetError()) == Verdict(
        ServeState.UNHEALTHY, "Probe failed: ConnectionResetError"
    )


def test_long_bodies_are_truncated_in_verdicts() -> None:
    verdict = classify_healthz(500, "x" * 10_000)
    assert verdict.state is ServeState.UNHEALTHY
    assert verdict.reason.startswith("HTTP 500: xxx")
    assert verdict.reason.endswith("...")
    assert len(verdict.reason.encode()) == REASON_MAX_BYTES

    verdict = classify_healthz(503, "y" * 10_000)
    assert verdict.state is ServeState.NOT_READY
    assert len(verdict.reason.encode()) == REASON_MAX_BYTES

    verdict = classify_routes(200, "not json " * 100)
    assert verdict.state is ServeState.UNHEALTHY
    assert len(verdict.reason.encode()) <= REASON_MAX_BYTES

    verdict = classify.transport_error(OSError("z" * 1000))
    assert len(verdict.reason.encode()) <= REASON_MAX_BYTES


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", "", id="empty"),
        pytest.param("short reason", "short reason", id="short"),
        pytest.param("  padded\n", "padded", id="stripped"),
        pytest.param("a" * 256, "a" * 256, id="ascii-exactly-256"),
        pytest.param("a" * 257, "a" * 253 + "...", id="ascii-257"),
        pytest.param("a" * 1000, "a" * 253 + "...", id="ascii-1000"),
        pytest.param("é" * 128, "é" * 128, id="2-byte-exactly-256"),
        # 253 bytes would end in the middle of the 127th "é": it is dropped, not split.
        pytest.param("é" * 129, "é" * 126 + "...", id="2-byte-split"),
        pytest.param("€" * 100, "€" * 84 + "...", id="3-byte-split"),
        pytest.param("🙂" * 100, "🙂" * 63 + "...", id="4-byte-split"),
        pytest.param("a" + "🙂" * 100, "a" + "🙂" * 63 + "...", id="4-byte-offset-1"),
        pytest.param("ab" + "🙂" * 100, "ab" + "🙂" * 62 + "...", id="4-byte-offset-2"),
    ],
)
def test_truncate_reason(text: str, expected: str) -> None:
    result = truncate_reason(text)
    assert result == expected
    assert len(result.encode()) <= REASON_MAX_BYTES
    assert "\ufffd" not in result


@pytest.mark.parametrize("char", ["a", "é", "€", "🙂", "中"])
@pytest.mark.parametrize("length", [200, 255, 256, 257, 300, 5000])
def test_truncate_reason_never_splits_a_character(char: str, length: int) -> None:
    text = "x" + char * length
    result = truncate_reason(text)
    encoded = result.encode()
    assert len(encoded) <= REASON_MAX_BYTES
    assert "\ufffd" not in result
    if len(text.encode()) <= REASON_MAX_BYTES:
        assert result == text
    else:
        assert result.endswith("...")
        kept = result.removesuffix("...")
        assert text.startswith(kept)
        # As much as fits: adding the next character would pass the limit.
        next_char = text[len(kept)]
        assert len((kept + next_char).encode()) + 3 > REASON_MAX_BYTES


README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize(
    ("row", "answers"),
    [
        pytest.param(
            "| 503 whose body's first line is `This node is being drained.` | `DRAINING` |",
            [(503, DRAINING), (503, DRAINING + FORGED), (503, f"{DRAINING}\r\nmore")],
            id="draining",
        ),
        pytest.param(
            f"| 503 `{NOT_POPULATED}` / `{NO_REPLICAS}` | `NOT_READY` |",
            [(503, NOT_POPULATED), (503, NO_REPLICAS)],
            id="not-ready",
        ),
        pytest.param(
            "| 503 `Service Unavailable` (HAProxy mode: no backend is up) | `NOT_READY` |",
            [(503, "Service Unavailable"), (503, " Service Unavailable\n")],
            id="haproxy-no-backend",
        ),
        pytest.param(
            "| 503 with any other body, or none | `NOT_READY` |",
            [(503, "Service Unavailabl"), (503, "<html>upstream error</html>"), (503, "")],
            id="other-503",
        ),
        pytest.param(
            "| 404 `Path '/-/healthz' not found. ...` (HAProxy mode: a worker with no application "
            "left) | `NOT_READY` |",
            [
                (
                    404,
                    "Path '/-/healthz' not found. Ping http://.../-/routes for available routes.",
                )
            ],
            id="haproxy-no-healthz-rule",
        ),
        pytest.param(
            "| any other status, or 200 with any body but `success` | `UNHEALTHY` |",
            [(500, "success"), (502, DRAINING), (504, ""), (404, ""), (301, ""), (200, "ok")],
            id="other-status",
        ),
    ],
)
def test_the_readme_state_table_says_what_classify_does(
    row: str, answers: list[tuple[int, str]]
) -> None:
    assert row in README
    state = row.rsplit("`", 2)[-2]
    for status, body in answers:
        assert classify_healthz(status, body).state.name == state, (status, body)


GRPC_README_ROWS = [
    (
        "| OK, message `success` (Ray), or none (HAProxy mode) | `SERVING` |",
        [("OK", "success"), ("OK", None), ("OK", ""), ("OK", " success\n")],
    ),
    (
        "| UNAVAILABLE `This node is being drained.` | `DRAINING` |",
        [("UNAVAILABLE", DRAINING), ("UNAVAILABLE", DRAINING + "\nmore")],
    ),
    (
        "| UNAVAILABLE `Route table is not populated yet.` / `No replicas are available yet.` / "
        "`Service Unavailable` (HAProxy mode) | `NOT_READY` |",
        [
            ("UNAVAILABLE", NOT_POPULATED),
            ("UNAVAILABLE", NO_REPLICAS),
            ("UNAVAILABLE", "Service Unavailable"),
        ],
    ),
    (
        "| NOT_FOUND `Application metadata not set. ...` (HAProxy mode: a worker with no gRPC "
        "application) | `NOT_READY` |",
        [
            (
                "NOT_FOUND",
                "Application metadata not set. Ping "
                "/ray.serve.RayServeAPIService/ListApplications for available applications.",
            )
        ],
    ),
    (
        "| any other status or message, or OK with another message | `UNHEALTHY` |",
        [
            ("OK", "Success"),
            ("UNAVAILABLE", "Socket closed"),
            ("UNAVAILABLE", ""),
            ("UNAVAILABLE", None),
            ("INTERNAL", DRAINING),
            ("NOT_FOUND", "Application 'x' not found."),
            ("UNIMPLEMENTED", ""),
        ],
    ),
]


@pytest.mark.parametrize(("row", "answers"), GRPC_README_ROWS)
def test_the_readme_grpc_table_says_what_classify_does(
    row: str, answers: list[tuple[str, str | None]]
) -> None:
    assert row in README
    state = row.rsplit("`", 2)[-2]
    for code, message in answers:
        assert classify.classify_grpc_healthz(code, message).state.name == state, (code, message)


def test_the_readme_grpc_transport_rows() -> None:
    assert "| connection refused | `NO_PROXY` |" in README
    assert "| timeout or another transport error | `UNHEALTHY` |" in README


SERVING = Verdict(ServeState.SERVING, "success")


@pytest.mark.parametrize(
    ("http", "grpc", "expected"),
    [
        (SERVING, SERVING, SERVING),
        (
            SERVING,
            Verdict(ServeState.NOT_READY, "x"),
            Verdict(ServeState.NOT_READY, "gRPC proxy h:9000: x"),
        ),
        (
            Verdict(ServeState.UNHEALTHY, "hang"),
            SERVING,
            Verdict(ServeState.UNHEALTHY, "HTTP proxy: hang"),
        ),
        (
            Verdict(ServeState.NO_PROXY, "refused"),
            Verdict(ServeState.DRAINING, "drain"),
            Verdict(ServeState.NO_PROXY, "HTTP proxy: refused | gRPC proxy h:9000: drain"),
        ),
    ],
)
def test_worse_of_two_proxies(http: Verdict, grpc: Verdict, expected: Verdict) -> None:
    assert classify.worse_of(http, grpc, "gRPC proxy h:9000") == expected


def test_worse_of_keeps_the_reason_within_the_limit() -> None:
    long = Verdict(ServeState.NOT_READY, "x" * REASON_MAX_BYTES)
    combined = classify.worse_of(long, long, "gRPC proxy h:9000")
    assert len(combined.reason.encode()) <= REASON_MAX_BYTES
