"""Issue 28, point 6: where the pods land, and what they ask for.

- The DaemonSet agents run on Linux nodes only (``nodeSelector: kubernetes.io/os: linux``):
  they tolerate every taint, so without it a Windows node gets an agent that never starts, and
  ``kubectl rollout status`` never completes.
- The aggregator prefers nodes without GPUs (a preferred node affinity on
  ``nvidia.com/gpu.present``, the label NVIDIA's GPU Operator and GPU feature discovery put on
  GPU nodes), so that it does not take a GPU node's room from Ray workers; a preference only,
  so that a cluster of GPU nodes alone still runs it.
- The agents' memory requests are at or above their measured RSS (docs/benchmarks.md: the
  DaemonSet agent's, with the Kubernetes client it lists its node's pods with, in fallback
  too; the sidecar's, with its endpoint on).
- docs/install.md says what ``preemptionPolicy: Never`` does to ``kubectl rollout status`` on
  packed nodes, and which GPU label the aggregator avoids."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.manifests import ROOT, find, pod_specs, render, renderable

AGGREGATOR = "ray-serve-health-aggregator"
AGENT = "ray-serve-health-agent"
GPU_LABEL = "nvidia.com/gpu.present"
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
INSTALL = (ROOT / "docs" / "install.md").read_text()
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def rendering(kind: str, name: str) -> list[str]:
    """The renderable directories with a ``kind`` named ``name``."""
    return [
        str(directory)
        for directory in renderable()
        if any(o["kind"] == kind and o["metadata"]["name"] == name for o in render(directory))
    ]


def quantity(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", text)
    assert match, f"not a memory quantity this test reads: {text}"
    return int(match[1]) * UNITS[match[2]]


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", BENCHMARKS, re.M | re.S)
    assert match, f"docs/benchmarks.md has no section {title!r}"
    return match[1]


def mib(figure: str) -> int:
    return int(float(figure) * 2**20)


def daemonset_agent_rss() -> int:
    """The DaemonSet agent's peak RSS (VmHWM: connected, then in fallback)."""
    found = re.search(r"peak \(VmHWM\) ([\d.]+) MiB", section("DaemonSet agent footprint"))
    assert found, "docs/benchmarks.md, DaemonSet agent footprint: no peak (VmHWM) figure"
    return mib(found[1])


def sidecar_rss() -> int:
    """The sidecar's RSS with its endpoint on (``--metrics-listen``, as the example runs it)."""
    found = re.search(
        r"^\| HTTP and gRPC, `--metrics-listen` \(120 s\) \| [\d.]+ % \| ([\d.]+) MiB \|$",
        section("Agent footprint"),
        re.M,
    )
    assert found, "docs/benchmarks.md, Agent footprint: no figure with --metrics-listen"
    return mib(found[1])


@pytest.mark.parametrize("directory", rendering("DaemonSet", AGENT))
def test_daemonset_agents_run_on_linux_nodes_only(directory: str) -> None:
    spec = find(render(directory), "DaemonSet", AGENT)["spec"]["template"]["spec"]
    assert spec.get("nodeSelector", {}).get("kubernetes.io/os") == "linux"
    assert spec["tolerations"] == [{"operator": "Exists"}]  # still every taint


def gpu_free_preference(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The preferred node affinity terms that favour nodes without ``GPU_LABEL`` true."""
    node = spec.get("affinity", {}).get("nodeAffinity", {})
    return [
        term
        for term in node.get("preferredDuringSchedulingIgnoredDuringExecution", [])
        if term["weight"] > 0
        and any(
            e["key"] == GPU_LABEL
            and (
                e["operator"] == "DoesNotExist"
                or (e["operator"] == "NotIn" and "true" in e.get("values", []))
            )
            for e in term["preference"].get("matchExpressions", [])
        )
    ]


@pytest.mark.parametrize("directory", rendering("Deployment", AGGREGATOR))
def test_the_aggregator_prefers_nodes_without_gpus(directory: str) -> None:
    spec = find(render(directory), "Deployment", AGGREGATOR)["spec"]["template"]["spec"]
    assert gpu_free_preference(spec), "no preference for nodes without GPUs"
    # A preference, not a rule: a cluster of GPU nodes alone still runs the aggregator.
    required = spec["affinity"]["nodeAffinity"].get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    assert required is None or GPU_LABEL not in str(required)


def test_the_preference_is_not_vacuous() -> None:
    """NotIn matches a node without the label as well as one labelled false; a node labelled
    true is the one left out. (The scheduler's NotIn: absent or not among the values.)"""
    spec = find(render("deploy/overlays/readiness-gate-mode"), "Deployment", AGGREGATOR)
    (term,) = gpu_free_preference(spec["spec"]["template"]["spec"])
    (expression,) = term["preference"]["matchExpressions"]

    def matches(labels: dict[str, str]) -> bool:
        if expression["operator"] == "DoesNotExist":
            return expression["key"] not in labels
        return labels.get(expression["key"]) not in expression["values"]

    assert matches({})
    assert matches({GPU_LABEL: "false"})
    assert not matches({GPU_LABEL: "true"})


@pytest.mark.parametrize("directory", rendering("DaemonSet", AGENT))
def test_the_daemonset_agents_memory_request_covers_its_measured_rss(directory: str) -> None:
    spec = find(render(directory), "DaemonSet", AGENT)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    request = quantity(container["resources"]["requests"]["memory"])
    limit = quantity(container["resources"]["limits"]["memory"])
    assert request >= daemonset_agent_rss(), (request / 2**20, daemonset_agent_rss() / 2**20)
    assert limit >= request


@pytest.mark.parametrize(
    "directory", ["deploy/examples/rayservice-sidecar", "deploy/examples/rayservice-readiness-gate"]
)
def test_the_sidecars_memory_request_covers_its_measured_rss(directory: str) -> None:
    service = find(render(directory), "RayService")
    sidecars = [
        c
        for _, spec in pod_specs(service)
        for c in spec["containers"]
        if c.get("command", [""])[0] == "serve-health-agent"
    ]
    assert sidecars
    for container in sidecars:
        assert quantity(container["resources"]["requests"]["memory"]) >= sidecar_rss()


def test_install_docs_say_what_never_preempting_does_to_a_rollout() -> None:
    paragraphs = re.split(r"\n\n", INSTALL)
    found = [
        p
        for p in paragraphs
        if "preemptionPolicy: Never" in p and "rollout status" in p and "Pending" in p
    ]
    assert found, "docs/install.md: nothing on preemptionPolicy: Never and rollout status"
    assert f"`{GPU_LABEL}`" in INSTALL, "docs/install.md does not name the GPU label"
    assert "kubernetes.io/os: linux" in INSTALL
