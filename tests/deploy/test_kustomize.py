"""The kustomize manifests in deploy/: every kustomization renders with ``kubectl kustomize``, and
what it renders is what the docs promise: the image of this version, one aggregator replica with
native gRPC probes, restricted security contexts, agents with their downward-API identity,
settings that the commands accept, and each overlay's mode."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from aggregator.flags import AggregatorFlags
from aggregator.server import LIVENESS
from node_agent.flags import AgentFlags
from servehealth_common.config import describe, load
from tests.deploy.manifests import (
    ROOT,
    env_of,
    find,
    is_component,
    kustomizations,
    pod_specs,
    render,
    renderable,
)

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = "ghcr.io/ray-serve-health/ray-serve-health"
NAMESPACE = "ray-serve-health"
AGGREGATOR = "ray-serve-health-aggregator"
AGENT = "ray-serve-health-agent"
UID = 65532  # the Dockerfile's USER
COMMANDS = {"serve-health-aggregator": AggregatorFlags, "serve-health-agent": AgentFlags}
IDENTITY = {
    "POD_NAME": "metadata.name",
    "POD_NAMESPACE": "metadata.namespace",
    "POD_UID": "metadata.uid",
    "NODE_NAME": "spec.nodeName",
}

REQUIRED = [
    "deploy/base/aggregator",
    "deploy/base/agent-daemonset",
    "deploy/base/serve-service",
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/overlays/shadow-mode",
    "deploy/examples/rayservice-sidecar",
    "deploy/examples/rayservice-readiness-gate",
]
OVERLAYS = ["deploy/overlays/label-mode", "deploy/overlays/readiness-gate-mode"]
EXAMPLES = ["deploy/examples/rayservice-sidecar", "deploy/examples/rayservice-readiness-gate"]
SHADOW = "deploy/overlays/shadow-mode"  # one replica: OVERLAYS' leader-election test is not for it
WITH_OUR_CONTAINERS = [
    "deploy/base/aggregator",
    "deploy/base/agent-daemonset",
    *OVERLAYS,
    SHADOW,
    *EXAMPLES,
]


def ours(directory: str) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(object, pod spec, container) for every container running this project's image."""
    found = []
    for obj in render(directory):
        for _, spec in pod_specs(obj):
            for container in spec["containers"]:
                if container["image"].startswith(IMAGE):
                    found.append((obj, spec, container))
    assert found, f"{directory} runs no container of {IMAGE}"
    return found


def env_value(container: dict[str, Any], name: str) -> str:
    entry = env_of(container).get(name)
    assert entry is not None, f"{container['name']} has no {name}"
    assert "value" in entry, f"{container['name']}: {name} has no literal value"
    return str(entry["value"])


def expand(value: str, environ: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion, from the variables defined before."""
    return re.sub(r"\$\((\w+)\)", lambda m: environ.get(m[1], m[0]), value)


def aggregator_container(directory: str) -> dict[str, Any]:
    deployment = find(render(directory), "Deployment", AGGREGATOR)
    return deployment["spec"]["template"]["spec"]["containers"][0]


# -- every kustomization renders --------------------------------------------------------


def test_every_kustomization_the_docs_name_exists() -> None:
    present = {directory.as_posix() for directory in renderable()}
    assert set(REQUIRED) <= present, f"missing: {sorted(set(REQUIRED) - present)}"


@pytest.mark.parametrize("directory", [pytest.param(d, id=d.as_posix()) for d in renderable()])
def test_kustomization_renders(directory: Path) -> None:
    objects = render(directory)
    assert objects, f"{directory} renders nothing"
    seen = set()
    for obj in objects:
        assert obj.get("apiVersion"), obj
        assert obj.get("kind"), obj
        assert obj["metadata"].get("name"), obj
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        assert key not in seen, f"{directory} renders {key} twice"
        seen.add(key)


def test_every_component_is_rendered_by_some_kustomization() -> None:
    """A component does not render on its own; an example must use it, so it is rendered."""
    used = set()
    for directory in renderable():
        document = yaml.safe_load((ROOT / directory / "kustomization.yaml").read_text())
        for component in document.get("components", []):
            used.add((ROOT / directory / component).resolve())
    components = [d for d in kustomizations() if is_component(d)]
    assert components, "expected the readiness-gate component"
    for component in components:
        assert (ROOT / component).resolve() in used, f"no kustomization uses {component}"


@pytest.mark.parametrize("directory", [*OVERLAYS, SHADOW])
def test_overlay_puts_everything_in_one_namespace(directory: str) -> None:
    objects = render(directory)
    find(objects, "Namespace", NAMESPACE)
    for obj in objects:
        if obj["kind"] in {"Namespace", "ClusterRole", "ClusterRoleBinding"}:
            continue
        assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
    for binding in (o for o in objects if o["kind"] == "ClusterRoleBinding"):
        for subject in binding["subjects"]:
            assert subject["namespace"] == NAMESPACE, binding["metadata"]["name"]


# -- the image --------------------------------------------------------------------------


@pytest.mark.parametrize("directory", [pytest.param(d, id=d.as_posix()) for d in renderable()])
def test_every_image_is_pinned_and_ours_is_this_version(directory: Path) -> None:
    for obj in render(directory):
        for where, spec in pod_specs(obj):
            for container in spec.get("initContainers", []) + spec["containers"]:
                image = container["image"]
                name, _, tag = image.rpartition(":")
                assert name, f"{where}: {image} has no tag"
                assert "/" not in tag, f"{where}: {image} has no tag"
                assert tag != "latest", f"{where}: {image} is not pinned"
                if "ray-serve-health" in name:
                    assert image == f"{IMAGE}:{VERSION}", f"{where}: {image}"


# -- the aggregator ---------------------------------------------------------------------


@pytest.mark.parametrize("directory", ["deploy/base/aggregator", *OVERLAYS])
def test_aggregator_runs_a_leader_and_a_standby_with_native_grpc_probes(directory: str) -> None:
    objects = render(directory)
    deployment = find(objects, "Deployment", AGGREGATOR)
    # Two replicas elect a leader; a standby is never Ready, so an update that waited for
    # Ready new pods (maxUnavailable below 100%) would never finish.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": "100%"},
    }
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["serve-health-aggregator"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9090}
    # Readiness: the leader only (service ""); startup and liveness: any running replica.
    assert container["readinessProbe"]["grpc"] == {"port": 50051}
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051, "service": LIVENESS}, probe
    assert env_value(container, "SERVE_HEALTH_LEADER_ELECT") == "true"
    env = env_of(container)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    assert pod["spec"]["serviceAccountName"] == AGGREGATOR
    find(objects, "ServiceAccount", AGGREGATOR)

    service = find(objects, "Service", AGGREGATOR)
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("grpc", 50051, "grpc"),
        ("metrics", 9090, "metrics"),
    }
    # The addresses the aggregator listens on are the ones probed and exposed.
    assert env_value(container, "SERVE_HEALTH_LISTEN").endswith(":50051")
    assert env_value(container, "SERVE_HEALTH_METRICS_LISTEN").endswith(":9090")
    assert env_value(container, "SERVE_HEALTH_KUBE_BACKEND") == "kubernetes"


def test_label_mode_overlay_writes_the_label() -> None:
    container = aggregator_container("deploy/overlays/label-mode")
    assert env_value(container, "SERVE_HEALTH_MODE") == "label"


def test_shadow_mode_overlay_is_label_mode_in_dry_run_on_one_replica_without_a_lease() -> None:
    deployment = find(render(SHADOW), "Deployment", AGGREGATOR)
    assert deployment["spec"]["replicas"] == 1
    container = aggregator_container(SHADOW)
    assert env_value(container, "SERVE_HEALTH_MODE") == "label"
    assert env_value(container, "SERVE_HEALTH_DRY_RUN") == "true"
    assert env_value(container, "SERVE_HEALTH_LEADER_ELECT") == "false"  # a Lease is a write


def test_readiness_gate_overlay_writes_the_condition_its_example_gates_on() -> None:
    container = aggregator_container("deploy/overlays/readiness-gate-mode")
    assert env_value(container, "SERVE_HEALTH_MODE") == "condition"
    condition = env_value(container, "SERVE_HEALTH_CONDITION_TYPE")
    assert condition == AggregatorFlags.condition_type == "ray.io/serve-proxy-healthy"

    service = find(render("deploy/examples/rayservice-readiness-gate"), "RayService")
    gates = {
        where: [gate["conditionType"] for gate in spec.get("readinessGates", [])]
        for where, spec in pod_specs(service)
    }
    # Workers are gated on Serve health; the head never is (KubeRay waits for a Ready head
    # before it deploys the Serve applications).
    assert gates.pop("head") == []
    assert gates, "no worker group"
    assert all(value == [condition] for value in gates.values()), gates


def test_sidecar_example_has_no_gates() -> None:
    """Without the readiness-gate aggregator a gated pod would never be Ready."""
    service = find(render("deploy/examples/rayservice-sidecar"), "RayService")
    assert all("readinessGates" not in spec for _, spec in pod_specs(service))


# -- the agents -------------------------------------------------------------------------


@pytest.mark.parametrize("directory", ["deploy/base/agent-daemonset", *OVERLAYS])
def test_daemonset_runs_the_agent_in_daemonset_mode(directory: str) -> None:
    objects = render(directory)
    daemonset = find(objects, "DaemonSet", AGENT)
    spec = daemonset["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["command"] == ["serve-health-agent"]
    args = container["args"]
    assert args[args.index("--mode") + 1] == "daemonset"
    env = env_of(container)
    for name, field in IDENTITY.items():
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == field, name
    assert spec["serviceAccountName"] == AGENT
    assert spec.get("hostNetwork") is not True
    find(objects, "ServiceAccount", AGENT)


@pytest.mark.parametrize("directory", EXAMPLES)
def test_sidecar_runs_beside_the_ray_container_in_every_pod(directory: str) -> None:
    service = find(render(directory), "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    where_seen = []
    for where, spec in pod_specs(service):
        containers = spec["containers"]
        names = [c["name"] for c in containers if c.get("command") == ["serve-health-agent"]]
        assert len(names) == 1, f"{where}: expected one agent sidecar, found {names}"
        # KubeRay takes containers[0] as the Ray container.
        assert containers[0].get("command") != ["serve-health-agent"], where
        assert any(p.get("name") == "serve" for p in containers[0].get("ports", [])), where
        sidecar = next(c for c in containers if c["name"] == names[0])
        env = env_of(sidecar)
        for name, field in IDENTITY.items():
            assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == field, (where, name)
        host, _, port = env_value(sidecar, "SERVE_HEALTH_AGGREGATOR").rpartition(":")
        assert host.split(".")[:2] == [AGGREGATOR, NAMESPACE], host
        assert port == "50051", port
        where_seen.append(where)
    assert where_seen[0] == "head"
    assert len(where_seen) > 1, "no worker group"


# -- security ---------------------------------------------------------------------------


@pytest.mark.parametrize("directory", WITH_OUR_CONTAINERS)
def test_our_containers_are_restricted(directory: str) -> None:
    """The "restricted" Pod Security Standard, a read-only root, and the image's UID."""
    for obj, spec, container in ours(directory):
        pod = spec.get("securityContext", {})
        own = container.get("securityContext", {})

        def setting(key: str, own: dict[str, Any] = own, pod: dict[str, Any] = pod) -> Any:
            return own.get(key, pod.get(key))

        where = f"{obj['kind']} {obj['metadata']['name']} container {container['name']}"
        assert setting("runAsNonRoot") is True, where
        assert setting("runAsUser") == UID, where
        assert setting("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert own.get("allowPrivilegeEscalation") is False, where
        assert own.get("readOnlyRootFilesystem") is True, where
        assert own.get("capabilities", {}).get("drop") == ["ALL"], where
        assert not own.get("capabilities", {}).get("add"), where
        assert not own.get("privileged"), where
        assert set(container["resources"]["limits"]) >= {"cpu", "memory"}, where


# -- settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("directory", WITH_OUR_CONTAINERS)
def test_manifest_settings_are_settings_the_command_accepts(directory: str) -> None:
    """Every SERVE_HEALTH_* variable names a real setting (the commands ignore unknown ones,
    so a typo would silently do nothing), and the command accepts the values and flags."""
    for obj, _, container in ours(directory):
        command = container["command"][0]
        cls = COMMANDS[command]
        known = {row["env"] for row in describe(cls)}
        environ: dict[str, str] = {}
        for name, entry in env_of(container).items():
            if "valueFrom" in entry:
                environ[name] = f"downward-{name.lower()}"
                continue
            environ[name] = expand(str(entry["value"]), environ)
            if name.startswith("SERVE_HEALTH_"):
                assert name in known, f"{obj['metadata']['name']}: {command} has no {name}"
        try:
            settings = load(cls, container.get("args", []), environ, command, "")
        except SystemExit:
            pytest.fail(f"{command} rejects the settings in {directory} (see stderr)")
        assert dataclasses.is_dataclass(settings)


def test_serve_service_selects_the_aggregators_label() -> None:
    service = find(render("deploy/base/serve-service"), "Service")
    selector = service["spec"]["selector"]
    assert selector[AggregatorFlags.label_key] == "true"
    assert "ray.io/cluster" in selector
    assert service["spec"]["ports"][0]["targetPort"] == "serve"
