"""The agent with ``--grpc-proxy-port`` against Debian's haproxy answering as Ray's HAProxy mode.

Ray 2.60's HAProxy mode with gRPC ingress does not start with haproxy 2.6: the configuration it
renders sets ``tune.h2.be.*`` / ``tune.h2.fe.*`` (keywords haproxy 2.6 does not know:
"unknown keyword 'tune.h2.be.initial-window-size' in 'global' section"). So here haproxy 2.6
runs the parts of that configuration that answer health checks, rendered with jinja2 from Ray's
own templates as Ray renders them (``HAPROXY_HEALTHZ_RULES_TEMPLATE``, the ``/-/routes`` rule of
``HAPROXY_CONFIG_TEMPLATE``, ``HAPROXY_GRPC_HEALTHZ_RULES_TEMPLATE``), in front of nothing: a
backend's server is UP (no check) or in maintenance (``disabled``), which is all the rules ask
of it (``nbsrv(backend) ge 1``). One HTTP and one gRPC frontend per situation, one real agent
process per situation, all reporting to the session's aggregator process.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jinja2
import pytest
from ray.serve._private import haproxy
from ray.serve._private import haproxy_templates as templates

from servehealth_common.states import ServeState
from testsupport import harness

STATE_DEADLINE = 10.0


@dataclass(frozen=True)
class Situation:
    name: str
    state: ServeState
    reason: tuple[str, ...]  # what the pod's reason holds, in this order
    drained: bool = False
    routes: bool = True
    http_up: bool = True
    grpc_up: bool = True


UNAVAILABLE = "Service Unavailable"
DRAINED = "This node is being drained."
NOT_POPULATED = "Route table is not populated yet."
SITUATIONS = (
    Situation("healthy", ServeState.SERVING, ("success",)),
    Situation("no-server-up", ServeState.NOT_READY,
              (f"HTTP proxy: {UNAVAILABLE}", f": {UNAVAILABLE}"), http_up=False, grpc_up=False),
    Situation("draining", ServeState.DRAINING,
              (f"HTTP proxy: {DRAINED}", f": {DRAINED}"), drained=True),
    Situation("not-populated", ServeState.NOT_READY,
              (f"HTTP proxy: {NOT_POPULATED}", f": {NOT_POPULATED}"), routes=False),
    # HTTP serves, gRPC has no server up: the pod is not SERVING, and says why.
    Situation("grpc-down", ServeState.NOT_READY, ("gRPC proxy", f": {UNAVAILABLE}"),
              grpc_up=False),
)  # fmt: skip


def _routes_rule() -> str:
    """The ``/-/routes`` rules of Ray's HTTP frontend (``HAPROXY_CONFIG_TEMPLATE``)."""
    match = re.search(
        r"    acl routes path -i /-/routes\n.*?(    http-request return status "
        r"\{\{ route_info\.status \}\}[^\n]*if routes)",
        templates.HAPROXY_CONFIG_TEMPLATE,
        re.DOTALL,
    )
    assert match is not None, "Ray's /-/routes rule changed"
    return "    acl routes path -i /-/routes\n" + match[1]


def render_config(situations: tuple[Situation, ...], ports: dict[str, tuple[int, int]]) -> str:
    """An haproxy configuration: per situation an HTTP and a gRPC frontend with Ray's rules."""
    from ray.serve._private.common import RequestProtocol

    env = jinja2.Environment()
    env.filters["haproxy_fmt"] = haproxy._haproxy_fmt_literal
    server = haproxy.ServerConfig(name="replica", host="127.0.0.1", port=1)
    parts = [
        "global\n    maxconn 200\n",
        "defaults\n    mode http\n    timeout connect 1s\n"
        "    timeout client 10s\n    timeout server 10s\n",
    ]
    for situation in situations:
        http_port, grpc_port = ports[situation.name]
        cfg = haproxy.HAProxyConfig(
            is_head=True,
            has_received_routes=situation.routes,
            has_received_servers=True,
            pass_health_checks=not situation.drained,
            metrics_enabled=False,
        )
        http_backend = haproxy.BackendConfig(
            name=f"http-{situation.name}", path_prefix="/", app_name="app", servers=[server]
        )
        grpc_backend = haproxy.BackendConfig(
            name=f"grpc-{situation.name}",
            path_prefix="/",
            app_name="app",
            servers=[server],
            protocol=RequestProtocol.GRPC,
        )
        # As HAProxyApi._generate_config_file_internal: health and routes from HTTP backends.
        info = cfg.build_health_route_info([http_backend] if situation.routes else [])
        http_backends = [http_backend] if situation.routes else []
        grpc_backends = [grpc_backend] if situation.routes else []
        healthz = env.from_string(templates.HAPROXY_HEALTHZ_RULES_TEMPLATE).render(
            {"config": cfg, "backends": http_backends, "health_info": info}
        )
        routes = env.from_string(_routes_rule()).render({"route_info": info})
        grpc = env.from_string(templates.HAPROXY_GRPC_HEALTHZ_RULES_TEMPLATE).render(
            {"config": cfg, "backends": grpc_backends, "health_info": info}
        )
        parts.append(
            f"frontend http_{situation.name}\n    bind 127.0.0.1:{http_port}\n"
            f"{healthz}\n{routes}\n"
            f"frontend grpc_{situation.name}\n    bind 127.0.0.1:{grpc_port} proto h2\n{grpc}\n"
        )
        for name, up in (
            (http_backend.name, situation.http_up),
            (grpc_backend.name, situation.grpc_up),
        ):
            parts.append(
                f"backend {name}\n    server replica 127.0.0.1:1{'' if up else ' disabled'}\n"
            )  # fmt: skip
    return "".join(parts)


@pytest.fixture(scope="module")
def haproxy_ports(
    haproxy_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[int, int]]]:
    """Debian's haproxy with the configuration above; the (HTTP, gRPC) ports by situation."""
    ports = {s.name: (harness.free_port(), harness.free_port()) for s in SITUATIONS}
    directory = tmp_path_factory.mktemp("haproxy-grpc")
    config = directory / "haproxy.cfg"
    config.write_text(render_config(SITUATIONS, ports))
    check = subprocess.run(
        [haproxy_binary, "-c", "-f", str(config)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, f"haproxy -c:\n{check.stdout}{check.stderr}\n{config}"
    log = (directory / "haproxy.log").open("wb")
    process = subprocess.Popen(
        [haproxy_binary, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        http_port = ports["healthy"][0]
        deadline = time.monotonic() + 10
        while harness.http_get(f"http://{harness.HOST}:{http_port}/-/healthz")[0] == 0:
            assert process.poll() is None, (directory / "haproxy.log").read_text()
            assert time.monotonic() < deadline, "haproxy did not listen within 10 s"
            time.sleep(0.05)
        yield ports
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()


@pytest.fixture(scope="module")
def grpc_agents(
    haproxy_ports: dict[str, tuple[int, int]],
    e2e_log_dir: Path,
    aggregator_process: harness.AggregatorProcess,
) -> Iterator[dict[str, tuple[harness.PodIdentity, harness.Process]]]:
    """One agent per situation, probing its HTTP frontend with ``--grpc-proxy-port``."""
    started: dict[str, tuple[harness.PodIdentity, harness.Process]] = {}
    try:
        for situation in SITUATIONS:
            http_port, grpc_port = haproxy_ports[situation.name]
            pod = harness.PodIdentity(name=f"ray-haproxy-{situation.name}")
            agent = harness.start_agent(
                e2e_log_dir,
                aggregator_process.address,
                http_port,
                pod,
                name=f"agent-haproxy-{situation.name}",
                extra_args=["--grpc-proxy-port", str(grpc_port)],
            )
            started[situation.name] = (pod, agent)
        yield started
    finally:
        for _, agent in started.values():
            agent.stop()


@pytest.mark.parametrize("situation", SITUATIONS, ids=lambda s: s.name)
def test_agent_with_grpc_behind_haproxy_rules(
    situation: Situation,
    grpc_agents: dict[str, tuple[harness.PodIdentity, harness.Process]],
    aggregator_process: harness.AggregatorProcess,
    inspector: harness.Inspector,
) -> None:
    pod, agent = grpc_agents[situation.name]
    seen, took = inspector.wait_for_state(
        pod, situation.state, STATE_DEADLINE, logs=(agent, aggregator_process)
    )
    print(f"{situation.name}: {situation.state.name} after {took:.2f}s: {seen.reason!r}")
    assert re.fullmatch(".*".join(map(re.escape, situation.reason)) + ".*", seen.reason), (
        seen.reason
    )
    assert seen.reason.startswith(situation.reason[0]), seen.reason
    assert seen.desired_label == ("true" if situation.state is ServeState.SERVING else "false")
