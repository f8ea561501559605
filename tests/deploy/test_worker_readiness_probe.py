"""The decision that routes traffic is ours (issue 27): every RayService and RayCluster worker
template in deploy/ declares a readiness probe (so KubeRay injects none), that probe keeps
Ray's own liveness signal (the raylet, through the dashboard agent) and no container's
readiness probe checks the Serve proxy, as the aggregator judges it
(:func:`aggregator.kube.kubelet_probe.checks_serve`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aggregator.kube.kubelet_probe import checks_serve
from tests.deploy.manifests import render, renderable

RAYLET_HEALTH = "http://localhost:52365/api/local_raylet_healthz"


def ray_workloads() -> list[Path]:
    """The kustomizations that render a RayService or a RayCluster."""
    return [
        directory
        for directory in renderable()
        if any(obj["kind"] in ("RayService", "RayCluster") for obj in render(directory))
    ]


def workers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for obj in objects:
        if obj["kind"] == "RayService":
            cluster = obj["spec"]["rayClusterConfig"]
        elif obj["kind"] == "RayCluster":
            cluster = obj["spec"]
        else:
            continue
        for group in cluster.get("workerGroupSpecs", []):
            found.append((f"{obj['metadata']['name']}/{group['groupName']}", group["template"]))
    return found


def test_there_are_ray_workloads_to_check() -> None:
    assert {
        Path("deploy/examples/rayservice-sidecar"),
        Path("deploy/examples/rayservice-readiness-gate"),
    } <= set(ray_workloads())


@pytest.mark.parametrize("directory", ray_workloads(), ids=str)
def test_every_worker_declares_a_readiness_probe_without_the_proxy_check(directory: Path) -> None:
    groups = workers(render(directory))
    assert groups
    for where, template in groups:
        ray = template["spec"]["containers"][0]  # KubeRay's Ray container
        probe = ray.get("readinessProbe")
        assert probe, f"{directory} {where}: no readinessProbe, KubeRay injects its own"
        command = " ".join((probe.get("exec") or {}).get("command") or [])
        assert RAYLET_HEALTH in command, f"{directory} {where}: not Ray's raylet check"
        ports = [p["containerPort"] for p in ray.get("ports", []) if p.get("name") == "serve"]
        assert not checks_serve(template, ports[0] if ports else 8000, 0), (
            f"{directory} {where}: a readiness probe checks the Serve proxy"
        )
