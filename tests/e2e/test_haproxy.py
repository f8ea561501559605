"""End to end with Ray Serve in HAProxy mode (``RAY_SERVE_ENABLE_HA_PROXY=1``), Debian's haproxy.

HAProxy answers ``/-/healthz`` and ``/-/routes`` itself, from rules Ray renders from its
templates (``ray/serve/_private/haproxy_templates.py``). A real agent process probes HAProxy's
HTTP frontend and reports to the session's aggregator process; after each step the pod must
reach the state that step causes. What HAProxy answers on the head node (Ray 2.60):

- Serve up, no application: 200 ``success`` (the head stays ready with no backends) and
  ``/-/routes`` ``{}``: NOT_READY (right after start, briefly, 503 ``Route table is not
  populated yet.``: NOT_READY too).
- An application: 200 ``success``, ``/-/routes`` ``{"/":"app"}``: SERVING.
- Drained: 503 ``This node is being drained.`` (both paths): DRAINING.
- Application deleted: its backend is gone, so the head's answer is the no-application one.
- No server of the application's backend UP (its replica and the head's fallback proxy, the
  backend's backup server, frozen): 503 ``Service Unavailable``: NOT_READY, never UNHEALTHY.

Ray's HAProxy mode with gRPC ingress does not start with haproxy 2.6: the configuration it
renders has ``tune.h2.be.*`` / ``tune.h2.fe.*``, keywords haproxy 2.6 does not know.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from bench.ray_haproxy import RayHAProxy
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.classify import DRAINING_BODY
from servehealth_common.states import ServeState
from testsupport import harness

#: A step that HAProxy shows at once (a reload, a new backend): the agent's interval, its
#: confirmation, the aggregator's two SERVING reports, with room for a loaded machine.
STATE_DEADLINE = 5.0
#: HAProxy checks each server every second (bench.ray_haproxy sets it) and marks it DOWN after
#: two failures, each a 1 s check timeout: ~3 s before the 503, plus the agent's part.
DOWN_DEADLINE = 10.0

POD = harness.PodIdentity(namespace="default", name="ray-head-haproxy", node_name="node-haproxy")


@pytest.fixture(scope="module")
def haproxy_agent(
    serve_haproxy: RayHAProxy,
    e2e_log_dir: Path,
    aggregator_process: harness.AggregatorProcess,
) -> Iterator[harness.Process]:
    """An agent process probing HAProxy's HTTP frontend for POD."""
    process = harness.start_agent(
        e2e_log_dir, aggregator_process.address, serve_haproxy.http_port, POD, name="agent-haproxy"
    )
    try:
        yield process
    finally:
        process.stop()


class Transitions:
    """Every state POD enters while the ``with`` block runs (WatchTransitions, on a thread)."""

    def __init__(self, inspector: harness.Inspector) -> None:
        self._stream = inspector.watch(POD.namespace)
        self.states: list[ServeState] = []
        self._thread = threading.Thread(target=self._read, name="transitions", daemon=True)

    def _read(self) -> None:
        try:
            for transition in self._stream:
                if transition.name == POD.name:
                    self.states.append(ServeState(transition.to_state))
        except grpc.RpcError:
            pass  # cancelled by __exit__

    def __enter__(self) -> Transitions:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stream.cancel()
        self._thread.join(5)


def until(check: Callable[[], bool], timeout: float) -> bool:
    """Whether ``check`` holds within ``timeout`` seconds, polled every 0.1 s (a real process
    outside this test: Ray, HAProxy)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.timeout(300)  # Ray's start (~10 s) and teardown count; the walk takes ~15 s
def test_pod_follows_ray_serve_in_haproxy_mode(
    serve_haproxy: RayHAProxy,
    haproxy_agent: harness.Process,
    aggregator_process: harness.AggregatorProcess,
    inspector: harness.Inspector,
) -> None:
    base_url = f"http://{harness.HOST}:{serve_haproxy.http_port}"
    logs = (haproxy_agent, aggregator_process)

    def step(
        name: str,
        action: Callable[[], object],
        state: ServeState,
        deadline: float = STATE_DEADLINE,
    ) -> pb.Pod:
        """Run ``action``; the pod must reach ``state`` within ``deadline`` of its return."""
        started = time.monotonic()
        action()
        acted = time.monotonic() - started
        seen, took = inspector.wait_for_state(POD, state, deadline, logs=logs)
        print(f"{name}: call took {acted:.2f}s, then {state.name} after {took:.2f}s")
        assert seen.desired_label == ("true" if state is ServeState.SERVING else "false"), name
        assert seen.agent_connected, name
        return seen

    with Transitions(inspector) as transitions:
        # 0. Serve up, no application: HAProxy on the head says success, the routes are {}.
        empty = step("no application", lambda: None, ServeState.NOT_READY)
        assert empty.reason in (
            "No applications are deployed (empty route table).",
            "Route table is not populated yet.",
        )

        # 1. An application at "/".
        serving = step("deploy", serve_haproxy.deploy, ServeState.SERVING)
        assert serving.http_status == 200
        assert harness.http_get(f"{base_url}/") == (200, "hello\n")
        assert harness.http_get(f"{base_url}/-/routes") == (200, '{"/":"app"}')

        # 2. Drain the HAProxyManager through its actor: HAProxy reloads with a forced failure.
        draining = step("drain", lambda: serve_haproxy.set_draining(True), ServeState.DRAINING)
        assert draining.http_status == 503
        assert draining.reason == DRAINING_BODY
        assert harness.http_get(f"{base_url}/-/healthz") == (503, DRAINING_BODY)

        # 3. Undrain: back in service.
        step("undrain", lambda: serve_haproxy.set_draining(False), ServeState.SERVING)

        # 4. Delete the application: its backend goes; the head still says success, with {}.
        deleted = step("delete", serve_haproxy.delete, ServeState.NOT_READY)
        assert deleted.http_status == 200
        assert "empty route table" in deleted.reason
        assert harness.http_get(f"{base_url}/-/healthz") == (200, "success")

        # 5. Again, then no server of its backend UP: HAProxy's own 503. Frozen only once
        # HAProxy routes to the new replica: the head says success before the application is
        # ready (its fallback proxy is a server too), and HAProxy's reload when the route table
        # changes may answer 503 for a moment, which the freeze step would take for its own
        # (it did once in CI: NOT_READY 0.26 s after the freeze, then 200 again).
        step("redeploy", serve_haproxy.deploy, ServeState.SERVING)
        routed = until(lambda: harness.http_get(f"{base_url}/") == (200, "hello\n"), 20.0)
        assert routed, "HAProxy never routed / to the redeployed application"
        try:
            frozen = step("no server up", serve_haproxy.freeze, ServeState.NOT_READY, DOWN_DEADLINE)
            assert frozen.http_status == 503
            assert frozen.reason.startswith("Service Unavailable")
            assert harness.http_get(f"{base_url}/-/healthz") == (503, "Service Unavailable")
        finally:
            serve_haproxy.thaw()

        # 6. Its servers back UP (rise 2): in service again.
        step("servers up", lambda: None, ServeState.SERVING, DOWN_DEADLINE)

    print("states:", [state.name for state in transitions.states])
    assert ServeState.UNHEALTHY not in transitions.states
    assert ServeState.NOT_READY in transitions.states
