"""What an answer of a Ray Serve proxy means: the one place that decides.

Pure functions, no I/O. The facts (Ray Serve 2.60, ``ray/serve/_private/proxy.py``):

================================================  ==================  ==========
answer to ``GET /-/healthz``                       ``/-/routes``       state
================================================  ==================  ==========
200 ``success``                                    non-empty JSON      SERVING
200 ``success``                                    ``{}``              NOT_READY
200 ``success``                                    not JSON            UNHEALTHY
503, first line ``This node is being drained.``    -                   DRAINING
503 ``Route table is not populated yet.``          -                   NOT_READY
503 ``No replicas are available yet.``             -                   NOT_READY
503 with any other body, or none                   -                   NOT_READY
any other status, or 200 with any other body       -                   UNHEALTHY
connection refused                                 -                   NO_PROXY
timeout, reset, other transport error              -                   UNHEALTHY
================================================  ==================  ==========

``/-/routes`` is asked only after ``success``; if it answers anything but 200, that answer is
classified by the same rows (a drained proxy's 503 is DRAINING there too).

The proxy keeps answering ``success`` after the last application is deleted (its route table
stays "populated", only empty), which is why a healthy answer is confirmed with ``/-/routes``.

Bodies are compared without surrounding whitespace. A 503 is classified by the first line of
its body: Ray's answer is that one line, and whatever something in front of the proxy (or a
hostile one) puts after it cannot hide a drain (issue 13). Every 503 takes the pod out of
service either way; the line only tells DRAINING from NOT_READY. A 200 must be exactly
``success``: the side that puts a pod in service accepts nothing but Ray's own answer.

An unknown 503 (none of Ray's bodies) is NOT_READY, not UNHEALTHY: something at the proxy's
address answered, for the proxy, that it cannot serve. That is a pod answering for itself, which
a blind aggregator would not see fleet-wide, so it does not count toward PANIC (only UNHEALTHY
and SILENT do); the README's state table says why, next to the same rows.

The reason is the whole body, stripped and cut to REASON_MAX_BYTES; it may hold line breaks
and other control characters, which the log formatters escape (``servehealth_common.logs``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from servehealth_common.states import ServeState

HEALTHY_BODY = "success"
DRAINING_BODY = "This node is being drained."
REASON_MAX_BYTES = 256


@dataclass(frozen=True, slots=True)
class Verdict:
    state: ServeState
    reason: str


def truncate_reason(text: str) -> str:
    """Limit a reason to REASON_MAX_BYTES of UTF-8 without splitting a character."""
    text = text.strip()
    encoded = text.encode()
    if len(encoded) <= REASON_MAX_BYTES:
        return text
    return encoded[: REASON_MAX_BYTES - 3].decode(errors="ignore") + "..."


def classify_healthz(status: int, body: str) -> Verdict:
    """Classify the answer to ``/-/healthz`` alone."""
    text = body.strip()
    if status == 200 and text == HEALTHY_BODY:
        return Verdict(ServeState.SERVING, HEALTHY_BODY)
    if status == 503:
        first_line = text.partition("\n")[0].strip()
        state = ServeState.DRAINING if first_line == DRAINING_BODY else ServeState.NOT_READY
        return Verdict(state, truncate_reason(text) or "HTTP 503")
    return Verdict(ServeState.UNHEALTHY, truncate_reason(f"HTTP {status}: {text}"))


def classify_routes(status: int, body: str) -> Verdict:
    """Classify the answer to ``/-/routes`` once ``/-/healthz`` said ``success``."""
    if status != 200:
        return classify_healthz(status, body)
    try:
        routes = json.loads(body)
    except ValueError:
        return Verdict(ServeState.UNHEALTHY, truncate_reason(f"/-/routes is not JSON: {body}"))
    if not routes:
        return Verdict(ServeState.NOT_READY, "No applications are deployed (empty route table).")
    return Verdict(ServeState.SERVING, HEALTHY_BODY)


def connection_refused() -> Verdict:
    return Verdict(ServeState.NO_PROXY, "Connection refused: no Serve proxy is listening.")


def timed_out(timeout: float) -> Verdict:
    return Verdict(ServeState.UNHEALTHY, f"No answer within {timeout * 1000:.0f} ms.")


def transport_error(error: BaseException) -> Verdict:
    detail = str(error) or type(error).__name__
    return Verdict(ServeState.UNHEALTHY, truncate_reason(f"Probe failed: {detail}"))
