"""What HAProxy answers in Ray's HAProxy mode, rendered from Ray's own templates, classified.

Ray (2.60, ``ray/serve/_private/haproxy.py``) renders ``HAPROXY_HEALTHZ_RULES_TEMPLATE`` and
``HAPROXY_GRPC_HEALTHZ_RULES_TEMPLATE`` with jinja2, its ``HAProxyConfig``, the node's backends
and ``HAProxyConfig.build_health_route_info``. These tests do the same for each situation, read
the ``http-request return`` rules the result holds, evaluate them as HAProxy would (the first
rule whose conditions hold answers; ``backend_<name>_server_up`` holds when that backend has a
server UP), and feed the answer to :mod:`servehealth_common.classify`. A request no rule
answers goes on to the frontend's default backend: for ``/-/healthz`` on the HTTP frontend
Ray's ``default_backend`` 404 (taken from ``HAPROXY_CONFIG_TEMPLATE``).

The end-to-end counterpart, with a real Ray and Debian's haproxy: tests/e2e/test_haproxy.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jinja2
from ray.serve._private import haproxy
from ray.serve._private import haproxy_templates as templates

from servehealth_common import classify
from servehealth_common.states import ServeState

HEALTHZ = "/-/healthz"

_RETURN = re.compile(
    r"^\s*http-request return status (?P<status>\d+) content-type (?P<type>\S+)"
    r'(?: string "(?P<body>(?:[^"\\]|\\.)*)")?(?P<hdrs>(?: hdr \S+ (?:"(?:[^"\\]|\\.)*"|\S+))*)'
    r" if (?P<cond>.+)$"
)
_HDR = re.compile(r'hdr (\S+) ("(?:[^"\\]|\\.)*"|\S+)')
_SERVER_UP = re.compile(r"^backend_(?P<backend>.+)_server_up$")


def _unquote(text: str) -> str:
    """An HAProxy double-quoted string's content."""
    if text.startswith('"') and text.endswith('"'):
        text = text[1:-1]
    return re.sub(r"\\(.)", r"\1", text)


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: str
    headers: dict[str, str]


def answer(rules: str, servers_up: frozenset[str] = frozenset()) -> Answer | None:
    """The answer the rendered ``rules`` give to a health check; None if no rule answers."""
    for line in rules.splitlines():
        match = _RETURN.match(line)
        if match is None:
            continue
        holds = True
        for condition in match["cond"].split():
            up = _SERVER_UP.match(condition)
            if up is not None:
                holds = holds and up["backend"] in servers_up
            else:
                assert condition in ("healthcheck", "is_healthz"), line
        if holds:
            headers = {name: _unquote(value) for name, value in _HDR.findall(match["hdrs"])}
            return Answer(
                int(match["status"]), match["type"], _unquote(match["body"] or ""), headers
            )
    return None


def default_backend_404(path: str) -> tuple[int, str]:
    """Ray's ``default_backend`` answer for ``path`` (an ``lf-string`` with ``%[path]``)."""
    match = re.search(
        r"backend default_backend\n\s*http-request return status (\d+) content-type \S+ "
        r'lf-string "((?:[^"\\]|\\.)*)"',
        templates.HAPROXY_CONFIG_TEMPLATE,
    )
    assert match is not None, "Ray's default_backend changed"
    return int(match[1]), _unquote(match[2]).replace("%[path]", path)


def render(template: str, config: object, backends: list[object]) -> str:
    """As ``HAProxyApi._generate_config_file_internal`` renders the health rules."""
    env = jinja2.Environment()
    env.filters["haproxy_fmt"] = haproxy._haproxy_fmt_literal
    return env.from_string(template).render(
        {
            "config": config,
            "backends": backends,
            "health_info": config.build_health_route_info(backends),  # type: ignore[attr-defined]
        }
    )


def config(
    *,
    is_head: bool = True,
    routes: bool = True,
    servers: bool = True,
    drained: bool = False,
) -> object:
    return haproxy.HAProxyConfig(
        is_head=is_head,
        has_received_routes=routes,
        has_received_servers=servers,
        pass_health_checks=not drained,
    )


def backend(name: str = "http-app", protocol: str = "HTTP") -> object:
    from ray.serve._private.common import RequestProtocol

    return haproxy.BackendConfig(
        name=name,
        path_prefix="/",
        app_name="app",
        servers=[haproxy.ServerConfig(name="SERVE_REPLICA_app", host="127.0.0.1", port=30001)],
        protocol=RequestProtocol[protocol],
    )


def http_verdict(
    cfg: object, backends: list[object], servers_up: frozenset[str] = frozenset()
) -> tuple[int, str, classify.Verdict]:
    """HAProxy's answer to ``GET /-/healthz`` and its classification (``/-/routes`` is not
    asked here: only after ``success``)."""
    rules = render(templates.HAPROXY_HEALTHZ_RULES_TEMPLATE, cfg, backends)
    found = answer(rules, servers_up)
    status, body = (found.status, found.body) if found else default_backend_404(HEALTHZ)
    return status, body, classify.classify_healthz(status, body)


# -- HTTP: /-/healthz -----------------------------------------------------------------------


def test_a_backend_with_a_server_up_is_success() -> None:
    status, body, verdict = http_verdict(config(), [backend()], frozenset({"http-app"}))
    assert (status, body) == (200, "success")
    assert verdict.state is ServeState.SERVING


def test_no_server_up_is_service_unavailable_and_not_ready() -> None:
    """The issue: HAProxy's own 503 is NOT_READY, not an anonymous UNHEALTHY (PANIC)."""
    status, body, verdict = http_verdict(config(), [backend()], frozenset())
    assert (status, body) == (503, "Service Unavailable")
    assert verdict.state is ServeState.NOT_READY
    assert verdict.reason.startswith("Service Unavailable")


def test_drained_is_draining() -> None:
    status, body, verdict = http_verdict(config(drained=True), [backend()], frozenset({"http-app"}))
    assert (status, body) == (503, "This node is being drained.")
    assert verdict == classify.Verdict(ServeState.DRAINING, "This node is being drained.")


def test_before_the_first_routes_is_not_ready() -> None:
    status, body, verdict = http_verdict(config(routes=False), [])
    assert (status, body) == (503, "Route table is not populated yet.")
    assert verdict == classify.Verdict(ServeState.NOT_READY, "Route table is not populated yet.")


def test_a_worker_without_servers_yet_is_not_ready() -> None:
    status, body, verdict = http_verdict(config(is_head=False, servers=False), [backend()])
    assert (status, body) == (503, "No replicas are available yet.")
    assert verdict == classify.Verdict(ServeState.NOT_READY, "No replicas are available yet.")


def test_the_head_without_backends_says_success_and_its_routes_decide() -> None:
    """The head stays ready with no backends; its ``/-/routes`` is ``{}``: NOT_READY."""
    cfg = config()
    status, body, verdict = http_verdict(cfg, [])
    assert (status, body, verdict.state) == (200, "success", ServeState.SERVING)
    routes = cfg.build_health_route_info([])  # type: ignore[attr-defined]
    assert (routes.status, routes.routes_message) == (200, "{}")
    assert classify.classify_routes(routes.status, routes.routes_message).state is (
        ServeState.NOT_READY
    )


def test_routes_of_a_node_with_an_application() -> None:
    cfg = config()
    routes = cfg.build_health_route_info([backend()])  # type: ignore[attr-defined]
    body = _unquote(f'"{routes.routes_message}"')  # HAProxy unescapes its string
    assert (routes.status, body) == (200, '{"/":"app"}')
    assert classify.classify_routes(routes.status, body).state is ServeState.SERVING


def test_a_worker_after_its_last_application_is_deleted_is_not_ready() -> None:
    # has_received_servers stays True once set (HAProxyApi.set_backend_configs): healthy,
    # no backends, not the head: the template renders no rule for /-/healthz at all.
    status, body, verdict = http_verdict(config(is_head=False, servers=True), [])
    assert status == 404
    assert body.startswith("Path '/-/healthz' not found.")
    assert verdict.state is ServeState.NOT_READY
