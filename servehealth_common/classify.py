"""What an answer of a Ray Serve proxy means: the one place that decides.

Pure functions, no I/O. The facts (Ray Serve 2.60, ``ray/serve/_private/proxy.py``):

==============================================  ==================  ==========
answer to ``GET /-/healthz``                     ``/-/routes``       state
==============================================  ==================  ==========
200 ``success``                                  non-empty JSON      SERVING
200 ``success``                                  ``{}``              NOT_READY
503 ``This node is being drained.``              any                 DRAINING
503 ``Route table is not populated yet.``        any                 NOT_READY
503 ``No replicas are available yet.``           any                 NOT_READY
any other 503                                    any                 NOT_READY
any other status or body                         any                 UNHEALTHY
connection refused                               -                   NO_PROXY
timeout, reset, other transport error            -                   UNHEALTHY
==============================================  ==================  ==========

The proxy keeps answering ``success`` after the last application is deleted (its route table
stays "populated", only empty), which is why a healthy answer is confirmed with ``/-/routes``.
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
        state = ServeState.DRAINING if text == DRAINING_BODY else ServeState.NOT_READY
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
