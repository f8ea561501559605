"""NetworkPolicies in deploy/: deploy/components/network-policy admits to the aggregator's gRPC
port only the DaemonSet agents and the sidecars (Ray pods, any namespace), to its metrics port
and the agents' only Prometheus's namespace, on the ports the containers really use, in the
aggregator's namespace; the Ray-namespace policy (an opt-in example, never part of an overlay)
admits the aggregator and the agents to the proxies' serve ports and the head's dashboard, and
leaves the user's own sources to fill in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.deploy.manifests import ROOT, find, render, renderable
from tests.deploy.test_tls import layered

INSTALL = "deploy/examples/production"
RAY_NAMESPACE = "deploy/examples/ray-namespace-network-policy"
AGGREGATOR = "ray-serve-health-aggregator"
AGENT = "ray-serve-health-agent"
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def pod_labels(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, str]:
    return find(objects, kind, name)["spec"]["template"]["metadata"]["labels"]


def container_ports(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, int]:
    spec = find(objects, kind, name)["spec"]["template"]["spec"]
    return {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector["matchLabels"].items() <= labels.items():
        return False
    return all(
        e["key"] in labels
        for e in selector.get("matchExpressions", [])
        if e["operator"] == "Exists"
    )


def rules(policy: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """port -> the peers admitted to it."""
    found: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            found.setdefault(port["port"], []).extend(rule["from"])
    return found


def test_the_aggregator_admits_agents_sidecars_and_prometheus_only() -> None:
    objects = render(INSTALL)
    policy = find(objects, "NetworkPolicy", AGGREGATOR)
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # its egress (API, pods) untouched
    assert selects(
        policy["spec"]["podSelector"],
        pod_labels(objects, "Deployment", AGGREGATOR),
    )
    ports = container_ports(objects, "Deployment", AGGREGATOR)
    by_port = rules(policy)
    assert set(by_port) == {ports["grpc"], ports["metrics"]}
    (agents, sidecars) = by_port[ports["grpc"]]
    assert set(agents) == {"podSelector"}  # this namespace
    assert selects(
        agents["podSelector"],
        pod_labels(objects, "DaemonSet", AGENT),
    )
    assert sidecars == {
        "namespaceSelector": {},
        "podSelector": {"matchExpressions": [{"key": "ray.io/node-type", "operator": "Exists"}]},
    }
    assert by_port[ports["metrics"]] == [PROMETHEUS]


def test_the_agents_admit_prometheus_only() -> None:
    objects = render(INSTALL)
    policy = find(objects, "NetworkPolicy", AGENT)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert selects(
        policy["spec"]["podSelector"],
        pod_labels(objects, "DaemonSet", AGENT),
    )
    ports = container_ports(objects, "DaemonSet", AGENT)
    assert rules(policy) == {ports["metrics"]: [PROMETHEUS]}


def test_the_policies_live_with_the_aggregator(tmp_path: Path) -> None:
    objects = render(INSTALL)
    namespace = find(objects, "Service", AGGREGATOR)["metadata"]["namespace"]
    for obj in objects:
        if obj["kind"] == "NetworkPolicy":
            assert obj["metadata"]["namespace"] == namespace
    for obj in layered(tmp_path, "platform", "deploy/components/network-policy"):
        if obj["kind"] == "NetworkPolicy":
            assert obj["metadata"]["namespace"] == "platform"


def test_the_ray_namespace_policy_is_opt_in() -> None:
    """It denies every other ingress to the Ray pods: no overlay or example install includes it."""
    target = (ROOT / RAY_NAMESPACE).resolve()
    for directory in renderable():
        document = yaml.safe_load((ROOT / directory / "kustomization.yaml").read_text())
        for entry in [*document.get("resources", []), *document.get("components", [])]:
            assert (ROOT / directory / entry).resolve() != target, directory
    text = (ROOT / RAY_NAMESPACE / "kustomization.yaml").read_text()
    assert "DENIES EVERY OTHER INGRESS" in text
    assert "FILL IN" in text


def test_the_ray_pods_admit_the_aggregator_and_the_agents_to_their_serve_ports() -> None:
    policy = find(render(RAY_NAMESPACE), "NetworkPolicy")
    assert "namespace" not in policy["metadata"]  # applied with -n <ray namespace>
    assert policy["spec"]["podSelector"] == {
        "matchExpressions": [{"key": "ray.io/node-type", "operator": "Exists"}]
    }
    install = render(INSTALL)
    ours = policy["spec"]["ingress"][0]
    (peer,) = ours["from"]
    namespace = find(install, "Service", AGGREGATOR)["metadata"]["namespace"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    for kind, name in (("Deployment", AGGREGATOR), ("DaemonSet", AGENT)):
        assert selects(peer["podSelector"], pod_labels(install, kind, name))
    # KubeRay's port names: the HTTP and gRPC proxies, and the dashboard the aggregator polls.
    assert {p["port"] for p in ours["ports"]} == {"serve", "serve-grpc", "dashboard"}
    sidecar = find(render("deploy/examples/rayservice-sidecar"), "RayService")
    head = sidecar["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert {"serve", "dashboard"} <= {p["name"] for p in head["containers"][0]["ports"]}
    # Ray's own traffic between its pods stays open.
    assert {"from": [{"podSelector": policy["spec"]["podSelector"]}]} in policy["spec"]["ingress"]
