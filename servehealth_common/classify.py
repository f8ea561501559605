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

HAProxy mode (Ray >= 2.56, ``RAY_SERVE_ENABLE_HA_PROXY=1``): HAProxy answers ``/-/healthz``
itself, with Ray's own bodies (``success``, the drain and not-populated messages) and one of its
own: 503 ``Service Unavailable`` when no backend has a server up. That is an ordinary 503, so
NOT_READY, with a reason that says what it means (:data:`HAPROXY_NO_BACKEND`). On a worker
whose last application was deleted, Ray renders no health rule at all: the request falls to
HAProxy's default backend, a 404 ``Path '/-/healthz' not found. ...`` (on gRPC, NOT_FOUND
``Application metadata not set. ...``). Both are NOT_READY: the node has no application, as
the ``/-/routes`` beside them (``{}``) says.

gRPC ingress (``/ray.serve.RayServeAPIService/Healthz``, :func:`classify_grpc_healthz`):

================================================  ==========
status and message                                state
================================================  ==========
OK, message ``success`` or none (HAProxy)         SERVING
UNAVAILABLE ``This node is being drained.``       DRAINING
UNAVAILABLE, Ray's not-populated or no-replicas   NOT_READY
message, or HAProxy's ``Service Unavailable``
NOT_FOUND ``Application metadata not set. ...``    NOT_READY
(HAProxy, a node with no gRPC application)
any other status or message                       UNHEALTHY
connection refused                                NO_PROXY
timeout, other transport error                    UNHEALTHY
================================================  ==========

Ray's proxy answers UNAVAILABLE with the same messages as its HTTP 503s; HAProxy answers HTTP
200 with ``grpc-status: 14`` (UNAVAILABLE) and ``Service Unavailable``, or its drain message,
and ``grpc-status: 0`` with no message when healthy. Unlike an HTTP 503, which only a server
sends, an UNAVAILABLE with other words is also what the gRPC library itself reports for a broken
connection: UNHEALTHY, as any transport failure. A pod with both ingresses is SERVING only
when both are (:func:`worse_of`).

The reason is the whole body, stripped and cut to REASON_MAX_BYTES; it may hold line breaks
and other control characters, which the log formatters escape (``servehealth_common.logs``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from servehealth_common.states import ServeState

HEALTHY_BODY = "success"
DRAINING_BODY = "This node is being drained."
#: HAProxy's own answer (Ray's HAProxy mode) when no backend has a server up.
HAPROXY_NO_BACKEND = "Service Unavailable"
#: HAProxy's default backend (Ray's HAProxy mode, a node with no application): the start of
#: its 404 to ``/-/healthz``, and of its NOT_FOUND to gRPC ``Healthz``.
HAPROXY_NO_HEALTHZ_RULE = "Path '/-/healthz' not found."
HAPROXY_NO_GRPC_BACKEND = "Application metadata not set."
#: What Ray's proxy says when it has no route table or no replica yet.
NOT_READY_BODIES = frozenset(
    {"Route table is not populated yet.", "No replicas are available yet.", HAPROXY_NO_BACKEND}
)
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
        return _unavailable(text, "HTTP 503")
    if status == 404 and text.startswith(HAPROXY_NO_HEALTHZ_RULE):
        return _no_application(text)
    return Verdict(ServeState.UNHEALTHY, truncate_reason(f"HTTP {status}: {text}"))


def _no_application(text: str) -> Verdict:
    return Verdict(
        ServeState.NOT_READY, truncate_reason(f"HAProxy: no application on this node: {text}")
    )


def _unavailable(text: str, empty: str) -> Verdict:
    """A proxy (or HAProxy for it) says it cannot serve: DRAINING by its first line, else
    NOT_READY."""
    first_line = text.partition("\n")[0].strip()
    if first_line == DRAINING_BODY:
        return Verdict(ServeState.DRAINING, truncate_reason(text))
    if text == HAPROXY_NO_BACKEND:
        return Verdict(ServeState.NOT_READY, f"{HAPROXY_NO_BACKEND} (HAProxy: no backend is up).")
    return Verdict(ServeState.NOT_READY, truncate_reason(text) or empty)


def classify_grpc_healthz(code: str, message: str | None) -> Verdict:
    """Classify a gRPC ``Healthz`` answer: ``code`` the status name (``OK``,
    ``UNAVAILABLE``...), ``message`` the response's ``message`` when it carried one (OK), else
    the status details. Transport failures go to :func:`connection_refused`,
    :func:`timed_out` and :func:`transport_error`."""
    text = (message or "").strip()
    if code == "OK":
        if text in ("", HEALTHY_BODY):
            return Verdict(ServeState.SERVING, HEALTHY_BODY)
        return Verdict(ServeState.UNHEALTHY, truncate_reason(f"OK with message: {text}"))
    first_line = text.partition("\n")[0].strip()
    if code == "UNAVAILABLE" and (first_line == DRAINING_BODY or first_line in NOT_READY_BODIES):
        return _unavailable(text, "UNAVAILABLE")
    if code == "NOT_FOUND" and text.startswith(HAPROXY_NO_GRPC_BACKEND):
        return _no_application(text)
    return Verdict(ServeState.UNHEALTHY, truncate_reason(f"{code}: {text}"))


def worse_of(http: Verdict, grpc: Verdict, grpc_name: str) -> Verdict:
    """The state of a pod with both ingresses: SERVING when both are, else the worse state
    (ServeState's order: NOT_READY < DRAINING < NO_PROXY < UNHEALTHY), the reason naming each
    ingress that is not serving (``grpc_name`` says which gRPC proxy)."""
    if http.state is ServeState.SERVING and grpc.state is ServeState.SERVING:
        return http
    parts = [f"HTTP proxy: {http.reason}"] if http.state is not ServeState.SERVING else []
    if grpc.state is not ServeState.SERVING:
        parts.append(f"{grpc_name}: {grpc.reason}")
    return Verdict(max(http.state, grpc.state), truncate_reason(" | ".join(parts)))


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
