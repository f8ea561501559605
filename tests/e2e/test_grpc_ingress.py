"""End to end with Ray Serve's gRPC ingress: a real Serve (HTTP and gRPC proxies, Ray's test
servicer) -> agent subprocesses given ``--grpc-proxy-port`` -> the aggregator subprocess.

Two agents probe the same Serve: one with the gRPC proxy's real port, one with a port where
nothing listens. The first follows both proxies (SERVING only when both serve); the second is
never SERVING, though HTTP is fine. Runs before ``test_ray_serve.py``, which ends by shutting
Serve down; it leaves no application behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servehealth_common.classify import DRAINING_BODY
from servehealth_common.states import ServeState
from testsupport import harness

STATE_DEADLINE = 5.0
GRPC_POD = harness.PodIdentity(namespace="default", name="ray-head-grpc", node_name="node-e2e")
DEAD_GRPC_POD = harness.PodIdentity(
    namespace="default", name="ray-head-grpc-dead", node_name="node-e2e"
)


@pytest.fixture
def grpc_agents(
    e2e_log_dir: Path,
    aggregator_process: harness.AggregatorProcess,
    ray_serve: int,
    serve_grpc_port: int,
) -> Iterator[tuple[harness.Process, harness.Process, int]]:
    dead_port = harness.free_port()
    started: list[harness.Process] = []
    try:
        for pod, port in ((GRPC_POD, serve_grpc_port), (DEAD_GRPC_POD, dead_port)):
            started.append(
                harness.start_agent(
                    e2e_log_dir,
                    aggregator_process.address,
                    ray_serve,
                    pod,
                    name=f"agent-{pod.name}",
                    extra_args=("--grpc-proxy-port", str(port)),
                )
            )
        yield started[0], started[1], dead_port
    finally:
        for process in started:
            process.stop()


def test_the_pod_serves_only_when_both_proxies_do(
    grpc_agents: tuple[harness.Process, harness.Process, int],
    aggregator_process: harness.AggregatorProcess,
    inspector: harness.Inspector,
    ray_serve: int,
    serve_grpc_port: int,
) -> None:
    agent, dead_agent, dead_port = grpc_agents
    logs = (agent, dead_agent, aggregator_process)

    def reach(pod: harness.PodIdentity, state: ServeState) -> str:
        seen, took = inspector.wait_for_state(pod, state, STATE_DEADLINE, logs=logs)
        print(f"{pod.name}: {state.name} after {took:.2f}s: {seen.reason}")
        return str(seen.reason)

    grpc_name = f"gRPC proxy 127.0.0.1:{serve_grpc_port}"
    try:
        # No application yet: both proxies say the route table is not populated.
        reason = reach(GRPC_POD, ServeState.NOT_READY)
        assert reason.startswith("HTTP proxy: Route table is not populated yet.")
        assert f"{grpc_name}: Route table is not populated yet." in reason

        # An application: both proxies serve.
        harness.deploy_app()
        reach(GRPC_POD, ServeState.SERVING)
        # Nothing listens at the other agent's gRPC port: never SERVING, though its HTTP proxy
        # (the same one) serves. It stayed NO_PROXY while HTTP moved: the new reason, naming
        # the gRPC proxy alone, travels all the same.
        refused = (
            f"gRPC proxy 127.0.0.1:{dead_port}: Connection refused: no Serve proxy is listening."
        )
        seen, _ = inspector.wait_for(
            DEAD_GRPC_POD,
            lambda pod: pod.state == ServeState.NO_PROXY and pod.reason == refused,
            "NO_PROXY for its gRPC proxy alone",
            STATE_DEADLINE,
            logs=logs,
        )
        assert seen.http_status == 200
        assert seen.desired_label == "false"

        # Drain the proxy actor: both of its ingresses drain.
        harness.set_draining(True)
        reason = reach(GRPC_POD, ServeState.DRAINING)
        assert reason == f"HTTP proxy: {DRAINING_BODY} | {grpc_name}: {DRAINING_BODY}"
        harness.set_draining(False)
        reach(GRPC_POD, ServeState.SERVING)

        # Two applications, one deleted while the other serves: still SERVING, never left.
        harness.deploy_app("second", route_prefix="/second")
        before, _ = inspector.wait_for_state(GRPC_POD, ServeState.SERVING, 1.0, logs=logs)
        harness.delete_app("app")
        routes = harness.http_get(f"http://{harness.HOST}:{ray_serve}/-/routes")
        assert routes[0] == 200
        assert json.loads(routes[1]) == {"/second": "second"}
        time.sleep(3 * 0.75)  # a few probes of both proxies (the agent's --interval: 750 ms)
        after, _ = inspector.wait_for_state(GRPC_POD, ServeState.SERVING, 1.0, logs=logs)
        still, _ = inspector.wait_for_state(DEAD_GRPC_POD, ServeState.NO_PROXY, 1.0, logs=logs)
        assert abs(still.state_since.ToNanoseconds() - seen.state_since.ToNanoseconds()) < 1_000_000
        # state_since is derived from the monotonic clock at each call: equal within rounding.
        moved = after.state_since.ToNanoseconds() - before.state_since.ToNanoseconds()
        assert abs(moved) < 1_000_000
    finally:
        harness.set_draining(False)
        for name in ("app", "second"):
            try:
                harness.delete_app(name)
            except Exception as error:  # leave Serve clean whatever happened
                print(f"delete {name}: {error}")
