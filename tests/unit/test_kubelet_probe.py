"""Whether the kubelet also checks a pod's Serve proxy (issue 27), from the pod's spec: KubeRay's
injected readiness probe of a RayService worker (the exec chain of the raylet check and the
proxy check) does, the raylet check alone does not, nor a probe on another port; an httpGet,
tcpSocket or grpc probe on the serve port (by number or by name) does. Warned once per Ray
cluster."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from aggregator.kube.kubelet_probe import KubeletWarnings, checks_serve, ready_condition

#: KubeRay's BaseWgetHealthCommand ("wget -T %d -q -O- http://localhost:%d/%s | grep success"),
#: joined by " && " under "bash -c" (ray-operator/controllers/ray/common/pod.go,
#: initReadinessProbe): a RayService worker gets the raylet check and the proxy check.
RAYLET = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
PROXY = "wget -T 2 -q -O- http://localhost:8000/-/healthz | grep success"
KUBERAY_SERVE_WORKER = {"exec": {"command": ["bash", "-c", f"{RAYLET} && {PROXY}"]}}
KUBERAY_RAYLET_ONLY = {"exec": {"command": ["bash", "-c", RAYLET]}}
SERVE_PORT, GRPC_PORT = 8000, 9000


def pod(*probes: dict[str, Any], ready: str | None = None) -> dict[str, Any]:
    containers = [
        {
            "name": f"c{index}",
            "ports": [
                {"name": "serve", "containerPort": SERVE_PORT},
                {"name": "serve-grpc", "containerPort": GRPC_PORT},
                {"name": "dashboard-agent", "containerPort": 52365},
            ],
            "readinessProbe": probe,
        }
        for index, probe in enumerate(probes)
    ]
    status = {"conditions": [{"type": "Ready", "status": ready}]} if ready else {}
    return {"spec": {"containers": containers}, "status": status}


@pytest.mark.parametrize(
    ("probe", "checks"),
    [
        pytest.param(KUBERAY_SERVE_WORKER, True, id="kuberay-exec-serve-worker"),
        pytest.param(KUBERAY_RAYLET_ONLY, False, id="kuberay-exec-raylet-only"),
        pytest.param(
            {"exec": {"command": ["sh", "-c", "curl -sf http://127.0.0.1:8000/ >/dev/null"]}},
            True,
            id="exec-naming-the-serve-port",
        ),
        pytest.param({"httpGet": {"path": "/-/healthz", "port": 8000}}, True, id="http-number"),
        pytest.param({"httpGet": {"path": "/-/healthz", "port": "serve"}}, True, id="http-name"),
        pytest.param({"httpGet": {"path": "/", "port": "8000"}}, True, id="http-digits"),
        pytest.param(
            {"httpGet": {"path": "/api/local_raylet_healthz", "port": 52365}},
            False,
            id="http-raylet",
        ),
        pytest.param({"tcpSocket": {"port": 8000}}, True, id="tcp-serve"),
        pytest.param({"grpc": {"port": 9000}}, True, id="grpc-serve-grpc"),
        pytest.param({"tcpSocket": {"port": "serve-grpc"}}, True, id="tcp-name-grpc"),
        pytest.param({"tcpSocket": {"port": 80}}, False, id="tcp-elsewhere"),
        pytest.param({"exec": {"command": ["cat", "/tmp/ready"]}}, False, id="exec-other"),
    ],
)
def test_which_probes_check_the_serve_proxy(probe: dict[str, Any], checks: bool) -> None:
    assert checks_serve(pod(probe), SERVE_PORT, GRPC_PORT) is checks


def test_any_container_counts_and_no_probe_checks_nothing() -> None:
    assert checks_serve(pod(KUBERAY_RAYLET_ONLY, KUBERAY_SERVE_WORKER), SERVE_PORT, 0)
    assert not checks_serve({"spec": {"containers": [{"name": "ray"}]}}, SERVE_PORT, 0)
    assert not checks_serve({}, SERVE_PORT, 0)


def test_the_ready_condition_as_last_seen() -> None:
    assert ready_condition(pod(KUBERAY_RAYLET_ONLY, ready="True")) == "True"
    assert ready_condition(pod(KUBERAY_RAYLET_ONLY, ready="False")) == "False"
    assert ready_condition(pod(KUBERAY_RAYLET_ONLY)) == ""


def test_one_warning_per_ray_cluster(caplog: pytest.LogCaptureFixture) -> None:
    warnings = KubeletWarnings()
    with caplog.at_level(logging.WARNING, logger="aggregator.kube.kubelet_probe"):
        warnings.seen("ray", "rs-1", "worker-a", checks=False)
        warnings.seen("ray", "rs-1", "worker-b", checks=True)
        warnings.seen("ray", "rs-1", "worker-c", checks=True)
        warnings.seen("ray", "rs-2", "worker-d", checks=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "Ray cluster ray/rs-1" in lines[0]
    assert "pod worker-b" in lines[0]
    assert "docs/install.md#" in lines[0]
