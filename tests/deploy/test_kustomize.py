"""The kustomize manifests in deploy/: every kustomization renders with ``kubectl kustomize``, and
what it renders is what the docs promise: the image of this version; two aggregator replicas,
both Ready (plaintext HTTP probes), behind a Service that selects the leader's label, with a
PodDisruptionBudget, a rollout strategy that completes, spread and priority; agents on every
node (all taints tolerated) with their downward-API identity, probes and metrics port; restricted
security contexts; settings that the commands accept, from one ConfigMap; and each overlay's
mode, label mode on workers only."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from aggregator.flags import AggregatorFlags
from node_agent.flags import AgentFlags
from servehealth_common.config import describe, load
from servehealth_common.version import __version__
from tests.deploy.manifests import (
    CLUSTER_SCOPED,
    ROOT,
    SETTINGS,
    env_of,
    environment,
    find,
    is_component,
    kustomizations,
    pod_specs,
    render,
    renderable,
    settings,
    settings_configmap,
)

VERSION = __version__
IMAGE = "ghcr.io/ray-serve-health/ray-serve-health"
NAMESPACE = "ray-serve-health"
AGGREGATOR = "ray-serve-health-aggregator"
METRICS_SERVICE = "ray-serve-health-aggregator-metrics"
AGENT = "ray-serve-health-agent"
UID = 65532  # the Dockerfile's USER
COMMANDS = {"serve-health-aggregator": AggregatorFlags, "serve-health-agent": AgentFlags}
IDENTITY = {
    "POD_NAME": "metadata.name",
    "POD_NAMESPACE": "metadata.namespace",
    "POD_UID": "metadata.uid",
    "NODE_NAME": "spec.nodeName",
}
# The plaintext health checks of both commands' metrics port (servehealth_common/metrics_http.py).
LIVEZ, READYZ = "/livez", "/readyz"
AGGREGATOR_METRICS_PORT, AGENT_METRICS_PORT = 9090, 9091

REQUIRED = [
    "deploy/base/aggregator",
    "deploy/base/agent-daemonset",
    "deploy/base/serve-service",
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/overlays/shadow-mode",
    "deploy/overlays/namespaced",
    "deploy/examples/rayservice-sidecar",
    "deploy/examples/rayservice-readiness-gate",
    "deploy/examples/production",
    "deploy/examples/tls-secret",
    "deploy/examples/ray-namespace-network-policy",
    "deploy/examples/both-mode",
]
# The installations with two replicas and leader election (shadow mode has one, and no Lease).
OVERLAYS = [
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/overlays/namespaced",
]
EXAMPLES = ["deploy/examples/rayservice-sidecar", "deploy/examples/rayservice-readiness-gate"]
SHADOW = "deploy/overlays/shadow-mode"
INSTALLS = [*OVERLAYS, SHADOW, "deploy/examples/production", "deploy/examples/tls-secret"]
WITH_OUR_CONTAINERS = [
    "deploy/base/aggregator",
    "deploy/base/agent-daemonset",
    *INSTALLS,
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


def aggregator_container(directory: str) -> dict[str, Any]:
    deployment = find(render(directory), "Deployment", AGGREGATOR)
    return deployment["spec"]["template"]["spec"]["containers"][0]


def aggregator_environment(directory: str) -> dict[str, str]:
    objects = render(directory)
    deployment = find(objects, "Deployment", AGGREGATOR)
    return environment(deployment["spec"]["template"]["spec"]["containers"][0], objects)


def agent_environment(directory: str) -> dict[str, str]:
    objects = render(directory)
    daemonset = find(objects, "DaemonSet", AGENT)
    return environment(daemonset["spec"]["template"]["spec"]["containers"][0], objects)


def probe(container: dict[str, Any], kind: str) -> tuple[str, int]:
    """(path, port number) of a container's ``kind`` probe, an HTTP GET on a named port."""
    get = container[kind]["httpGet"]
    assert set(container[kind]) & {"grpc", "exec", "tcpSocket"} == set(), kind
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
    assert get.get("scheme", "HTTP") == "HTTP", f"{kind}: probes stay plaintext"
    return get["path"], port


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


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


@pytest.mark.parametrize("directory", [pytest.param(d, id=d.as_posix()) for d in renderable()])
def test_cluster_scoped_objects_carry_no_namespace(directory: Path) -> None:
    """kustomize gives the admission policy's objects the overlay's namespace (it does not know
    they are cluster-scoped); the overlays take it off again."""
    for obj in render(directory):
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], (obj["kind"], obj["metadata"])


def test_every_component_is_rendered_by_some_kustomization() -> None:
    """A component does not render on its own; an example must use it, so it is rendered."""
    used = set()
    for directory in kustomizations():
        document = yaml.safe_load((ROOT / directory / "kustomization.yaml").read_text())
        for component in document.get("components", []):
            used.add((ROOT / directory / component).resolve())
    components = [d for d in kustomizations() if is_component(d)]
    assert len(components) >= 8, components
    rendered = {(ROOT / d).resolve() for d in renderable()}
    for component in components:
        assert (ROOT / component).resolve() in used, f"no kustomization uses {component}"
    # ... and through a renderable kustomization (a component may list another component).
    reached = set()
    frontier = list(rendered)
    while frontier:
        directory = frontier.pop()
        document = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for entry in [*document.get("components", []), *document.get("resources", [])]:
            target = (directory / entry).resolve()
            if (target / "kustomization.yaml").exists() and target not in reached:
                reached.add(target)
                frontier.append(target)
    for component in components:
        assert (ROOT / component).resolve() in reached, f"nothing renders {component}"


@pytest.mark.parametrize("directory", [d for d in INSTALLS if d != "deploy/overlays/namespaced"])
def test_overlay_puts_everything_in_one_namespace(directory: str) -> None:
    objects = render(directory)
    find(objects, "Namespace", NAMESPACE)
    for obj in objects:
        if obj["kind"] in CLUSTER_SCOPED:
            continue
        assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
    for binding in (o for o in objects if o["kind"] == "ClusterRoleBinding"):
        for subject in binding["subjects"]:
            assert subject["namespace"] == NAMESPACE, binding["metadata"]["name"]


def test_namespaced_overlay_puts_only_its_ray_grants_elsewhere() -> None:
    objects = render("deploy/overlays/namespaced")
    for obj in objects:
        if obj["kind"] in CLUSTER_SCOPED:
            continue
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] == "RoleBinding" and namespace == "ray":
            assert all(s["namespace"] == NAMESPACE for s in obj["subjects"]), obj["metadata"]
            continue
        assert namespace == NAMESPACE, obj["metadata"]


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
def test_aggregator_runs_two_ready_replicas_with_plaintext_http_probes(directory: str) -> None:
    objects = render(directory)
    deployment = find(objects, "Deployment", AGGREGATOR)
    assert deployment["spec"]["replicas"] == 2
    # Both new replicas start (and are Ready as standbys) before both old ones stop: one
    # failover per rollout, and `rollout status` completes.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["serve-health-aggregator"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": AGGREGATOR_METRICS_PORT}
    # Every probe on the plaintext metrics port: the gRPC port may be TLS-only.
    assert probe(container, "startupProbe") == (LIVEZ, AGGREGATOR_METRICS_PORT)
    assert probe(container, "livenessProbe") == (LIVEZ, AGGREGATOR_METRICS_PORT)
    assert probe(container, "readinessProbe") == (READYZ, AGGREGATOR_METRICS_PORT)
    env = environment(container, objects)
    assert env["SERVE_HEALTH_LEADER_ELECT"] == "true"
    assert env["SERVE_HEALTH_METRICS_LISTEN"].endswith(f":{AGGREGATOR_METRICS_PORT}")
    assert env["SERVE_HEALTH_LISTEN"].endswith(":50051")
    assert env["SERVE_HEALTH_KUBE_BACKEND"] == "kubernetes"
    named = env_of(container)
    assert named["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert named["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    assert pod["spec"]["serviceAccountName"] == AGGREGATOR
    find(objects, "ServiceAccount", AGGREGATOR)


@pytest.mark.parametrize("directory", ["deploy/base/aggregator", *OVERLAYS])
def test_only_the_leader_receives_agents_and_every_replica_is_scraped(directory: str) -> None:
    objects = render(directory)
    deployment = find(objects, "Deployment", AGGREGATOR)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    leader_label = settings(objects)["SERVE_HEALTH_LEADER_LABEL"]
    assert leader_label == AggregatorFlags.leader_label  # the setting's default, written out
    service = find(objects, "Service", AGGREGATOR)
    selector = dict(service["spec"]["selector"])
    assert selector.pop(leader_label) == "true"
    assert selects(selector, labels)
    assert leader_label not in labels, "only the leader labels its pod, at run time"
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("grpc", 50051, "grpc"),
        ("metrics", AGGREGATOR_METRICS_PORT, "metrics"),  # the leader's, for port-forward
    }
    metrics = find(objects, "Service", METRICS_SERVICE)
    assert selects(metrics["spec"]["selector"], labels)
    assert leader_label not in metrics["spec"]["selector"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in metrics["spec"]["ports"]] == [
        ("metrics", AGGREGATOR_METRICS_PORT, "metrics")
    ]


@pytest.mark.parametrize("directory", ["deploy/base/aggregator", *OVERLAYS, SHADOW])
def test_a_disruption_budget_never_blocks_a_drain(directory: str) -> None:
    objects = render(directory)
    deployment = find(objects, "Deployment", AGGREGATOR)
    budget = find(objects, "PodDisruptionBudget", AGGREGATOR)
    spec = budget["spec"]
    # maxUnavailable 1: one replica at a time with two, and drains still pass with one (shadow
    # mode); minAvailable 1 would refuse every eviction of a lone replica.
    assert spec["maxUnavailable"] == 1
    assert "minAvailable" not in spec
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert spec["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("directory", ["deploy/base/aggregator", *OVERLAYS])
def test_replicas_spread_over_nodes_and_zones_with_a_priority(directory: str) -> None:
    objects = render(directory)
    deployment = find(objects, "Deployment", AGGREGATOR)
    spec = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    spread = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert set(spread) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    node, zone = spread["kubernetes.io/hostname"], spread["topology.kubernetes.io/zone"]
    # Nodes: a hard rule that counts only nodes the pod may use (one eligible node takes both).
    assert node["whenUnsatisfiable"] == "DoNotSchedule"
    assert node["nodeTaintsPolicy"] == "Honor"
    # Zones: a preference (nodes without a zone label, one-zone clusters).
    assert zone["whenUnsatisfiable"] == "ScheduleAnyway"
    for constraint in spread.values():
        assert constraint["maxSkew"] == 1
        assert selects(constraint["labelSelector"]["matchLabels"], labels)
        assert constraint["matchLabelKeys"] == ["pod-template-hash"]
    priority = find(objects, "PriorityClass", spec["priorityClassName"])
    assert 0 < priority["value"] <= 1_000_000_000  # user classes; system ones are above
    assert priority["preemptionPolicy"] == "PreemptLowerPriority"
    assert priority.get("globalDefault") is False


@pytest.mark.parametrize("directory", ["deploy/base/aggregator", *INSTALLS])
def test_what_the_aggregator_writes_is_set_in_the_settings_configmap_only(directory: str) -> None:
    """The admission policy reads the ConfigMap: an `env` entry (which wins over envFrom) would
    let the aggregator write what the policy does not expect."""
    objects = render(directory)
    container = find(objects, "Deployment", AGGREGATOR)["spec"]["template"]["spec"]["containers"][0]
    configmap = settings_configmap(objects)
    assert container["envFrom"] == [{"configMapRef": {"name": configmap["metadata"]["name"]}}]
    data = settings(objects)
    written = {
        "SERVE_HEALTH_MODE",
        "SERVE_HEALTH_LABEL_KEY",
        "SERVE_HEALTH_CONDITION_TYPE",
        "SERVE_HEALTH_LEADER_LABEL",
        "SERVE_HEALTH_POD_SELECTOR",
    }
    assert written <= set(data), sorted(written - set(data))
    assert not set(data) & set(env_of(container)), "set in env too"
    # A hash suffix: a changed setting is a new name, and the pods roll (test_settings_roll.py).
    assert configmap["metadata"]["name"].startswith(f"{SETTINGS}-")


def test_label_mode_overlay_writes_the_label_on_workers_only() -> None:
    """KubeRay writes ray.io/serve on RayService heads on every reconcile: the default label
    mode never touches a head, and its agents report for the same pods."""
    environ = aggregator_environment("deploy/overlays/label-mode")
    assert environ["SERVE_HEALTH_MODE"] == "label"
    assert environ["SERVE_HEALTH_LABEL_KEY"] == "ray.io/serve"
    assert environ["SERVE_HEALTH_POD_SELECTOR"] == "ray.io/node-type=worker"
    assert agent_environment("deploy/overlays/label-mode")["SERVE_HEALTH_POD_SELECTOR"] == (
        "ray.io/node-type=worker"
    )


@pytest.mark.parametrize("directory", INSTALLS)
def test_daemonset_agents_track_the_aggregators_pods(directory: str) -> None:
    """A report for a pod the aggregator does not track is ignored: the DaemonSet takes the
    aggregator's selector and namespaces from its settings ConfigMap."""
    agent, aggregator = agent_environment(directory), aggregator_environment(directory)
    for name in ("SERVE_HEALTH_POD_SELECTOR", "SERVE_HEALTH_NAMESPACE"):
        assert agent.get(name) == aggregator.get(name), name


def test_daemonset_alone_falls_back_to_the_agents_defaults() -> None:
    """Without the aggregator's ConfigMap (the base on its own) the agent still starts."""
    daemonset = find(render("deploy/base/agent-daemonset"), "DaemonSet", AGENT)
    refs = [
        entry["valueFrom"]["configMapKeyRef"]
        for entry in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]
        if "configMapKeyRef" in entry.get("valueFrom", {})
    ]
    assert {ref["key"] for ref in refs} == {"SERVE_HEALTH_POD_SELECTOR", "SERVE_HEALTH_NAMESPACE"}
    assert all(ref["name"] == SETTINGS and ref["optional"] for ref in refs)


def test_namespaced_overlay_watches_its_ray_namespace() -> None:
    assert aggregator_environment("deploy/overlays/namespaced")["SERVE_HEALTH_NAMESPACE"] == "ray"
    assert agent_environment("deploy/overlays/namespaced")["SERVE_HEALTH_NAMESPACE"] == "ray"
    assert "SERVE_HEALTH_NAMESPACE" not in aggregator_environment("deploy/overlays/label-mode")


def test_shadow_mode_overlay_is_label_mode_in_dry_run_on_one_replica_without_a_lease() -> None:
    objects = render(SHADOW)
    deployment = find(objects, "Deployment", AGGREGATOR)
    assert deployment["spec"]["replicas"] == 1
    environ = aggregator_environment(SHADOW)
    assert environ["SERVE_HEALTH_MODE"] == "label"
    assert environ["SERVE_HEALTH_DRY_RUN"] == "true"
    assert environ["SERVE_HEALTH_LEADER_ELECT"] == "false"  # a Lease is a write
    # Nobody labels a leader, so the Service selects the one replica without that label.
    service = find(objects, "Service", AGGREGATOR)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], labels)


def test_readiness_gate_overlay_writes_the_condition_its_example_gates_on() -> None:
    environ = aggregator_environment("deploy/overlays/readiness-gate-mode")
    assert environ["SERVE_HEALTH_MODE"] == "condition"
    condition = environ["SERVE_HEALTH_CONDITION_TYPE"]
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
def test_daemonset_runs_the_agent_in_daemonset_mode_on_every_node(directory: str) -> None:
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
    # Every taint: GPU and other dedicated Ray pools are tainted.
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert "affinity" not in spec
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}  # Linux nodes only
    priority = find(objects, "PriorityClass", spec["priorityClassName"])
    assert priority["preemptionPolicy"] == "Never"  # never evicts a Ray pod to get in
    assert 0 < priority["value"] <= 1_000_000_000
    # Its own health and metrics, plaintext, on the port named metrics.
    assert env_value(container, "SERVE_HEALTH_METRICS_LISTEN") == f"0.0.0.0:{AGENT_METRICS_PORT}"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "metrics": AGENT_METRICS_PORT
    }
    assert probe(container, "livenessProbe") == (LIVEZ, AGENT_METRICS_PORT)
    assert probe(container, "readinessProbe") == (READYZ, AGENT_METRICS_PORT)
    assert "startupProbe" not in container


def test_ray_nodes_only_keeps_the_agents_to_labelled_nodes_and_every_taint() -> None:
    daemonset = find(render("deploy/examples/production"), "DaemonSet", AGENT)
    spec = daemonset["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "ray-serve-health/ray-node", "operator": "Exists"}]}
    ]
    assert spec["tolerations"] == [{"operator": "Exists"}]


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
        # A liveness probe on its own metrics port, and no readiness probe (it would gate the
        # Ray pod's readiness). Port names are unique in a pod: not the Ray container's.
        assert env_value(sidecar, "SERVE_HEALTH_METRICS_LISTEN") == f"0.0.0.0:{AGENT_METRICS_PORT}"
        assert probe(sidecar, "livenessProbe") == (LIVEZ, AGENT_METRICS_PORT)
        assert "readinessProbe" not in sidecar
        assert "startupProbe" not in sidecar
        names_in_pod = [p["name"] for c in containers for p in c.get("ports", []) if "name" in p]
        assert len(names_in_pod) == len(set(names_in_pod)), (where, names_in_pod)
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
    """Every SERVE_HEALTH_* variable (env, the settings ConfigMap) names a real setting (the
    commands ignore unknown ones, so a typo would silently do nothing), and the command accepts
    the values and flags."""
    objects = render(directory)
    for obj, _, container in ours(directory):
        command = container["command"][0]
        cls = COMMANDS[command]
        known = {row["env"] for row in describe(cls)}
        environ = environment(container, objects)
        for name in environ:
            if name.startswith("SERVE_HEALTH_"):
                assert name in known, f"{obj['metadata']['name']}: {command} has no {name}"
        # Files the TLS components mount do not exist here; the flags' own checks read them.
        environ = {k: v for k, v in environ.items() if not k.startswith("SERVE_HEALTH_TLS_")}
        try:
            loaded = load(cls, container.get("args", []), environ, command, "")
        except SystemExit:
            pytest.fail(f"{command} rejects the settings in {directory} (see stderr)")
        assert dataclasses.is_dataclass(loaded)


def test_serve_service_selects_the_aggregators_label() -> None:
    service = find(render("deploy/base/serve-service"), "Service")
    selector = service["spec"]["selector"]
    assert selector[AggregatorFlags.label_key] == "true"
    assert "ray.io/cluster" in selector
    assert service["spec"]["ports"][0]["targetPort"] == "serve"
