"""End to end with a real Ray Serve proxy: Serve -> agent subprocess -> aggregator subprocess.

One test walks the proxy through its life (deploy, drain, undrain, delete, shutdown) and, after
each step, polls the aggregator's ``InspectionService/GetPod`` until the pod reaches the state
that step should cause, within STATE_DEADLINE.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.classify import DRAINING_BODY
from servehealth_common.states import ServeState
from testsupport import harness

#: Agent: probe every 1 s (+-10 %), confirm a failure 100 ms later. Aggregator: 2 SERVING
#: reports (one at once, one at the next heartbeat ~1 s later) to come back into service.
STATE_DEADLINE = 3.0


def test_pod_follows_the_real_serve_proxy(
    ray_serve: int,
    inspector: harness.Inspector,
    pod: harness.PodIdentity,
    processes: tuple[harness.Process, ...],
) -> None:
    base_url = f"http://{harness.HOST}:{ray_serve}"

    def step(name: str, action: Callable[[], object], state: ServeState, label: str) -> pb.Pod:
        """Run ``action``; the pod must reach ``state`` within STATE_DEADLINE of its return."""
        started = time.monotonic()
        action()
        acted = time.monotonic() - started
        seen, took = inspector.wait_for_state(pod, state, STATE_DEADLINE, logs=processes)
        print(f"{name}: call took {acted:.2f}s, then {state.name} after {took:.2f}s")
        assert seen.desired_label == label, name
        assert seen.agent_connected, name
        return seen

    # 1. An application at "/": the proxy answers success and a non-empty route table.
    serving = step("deploy", harness.deploy_app, ServeState.SERVING, "true")
    assert harness.http_get(f"{base_url}/") == (200, "hello\n")
    assert serving.http_status == 200

    # 2. Drain the proxy through its actor: 503 "This node is being drained."
    draining = step("drain", lambda: harness.set_draining(True), ServeState.DRAINING, "false")
    assert draining.http_status == 503
    assert draining.reason == DRAINING_BODY
    # The controller never ordered this drain: its own view of the proxy stays HEALTHY, and it
    # calls update_draining only when that view changes (ProxyState.reconcile in
    # ray/serve/_private/proxy_state.py), so nothing undoes ours: the proxy still drains.
    assert harness.controller_proxy_status() == "HEALTHY"
    assert harness.http_get(f"{base_url}/-/healthz") == (503, DRAINING_BODY)

    # 3. Undrain: back in service after success_threshold (2) SERVING reports.
    step("undrain", lambda: harness.set_draining(False), ServeState.SERVING, "true")

    # 4. Delete the application: /-/healthz still says success, but /-/routes is {}.
    not_ready = step("delete", harness.delete_app, ServeState.NOT_READY, "false")
    assert harness.http_get(f"{base_url}/-/healthz") == (200, "success")
    assert not_ready.http_status == 200
    assert "empty route table" in not_ready.reason

    # 5. Shut Serve down: the proxy is gone, connections are refused.
    no_proxy = step("shutdown", harness.shutdown_serve, ServeState.NO_PROXY, "false")
    assert no_proxy.http_status == 0
    assert "Connection refused" in no_proxy.reason
