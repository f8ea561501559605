"""The RBAC rules in deploy/ grant exactly what the code calls, per mode, no more and no less.

All Kubernetes API calls go through two classes: ``KubeClient`` (servehealth_common/kube/client.py,
the reads: all the DaemonSet agent may do) and its subclass ``KubeApi`` (aggregator/kube/api.py,
the aggregator's writes and token reviews on top). The table below names each of their public
methods and the permissions it needs. The tests check that the table covers every public method
(a new one fails until it is added), that each method's ``self.<api>.<call>`` (``api`` one of
``API_OBJECTS``: ``core`` is CoreV1Api, ...) agrees with the permissions the table gives it,
that nothing else in the code calls the API, and that each installation binds exactly:

- cluster-wide (ClusterRoleBindings), or in each Ray namespace (RoleBindings, the namespaced
  overlay): what every mode calls, plus the write of its mode only (label mode: pods patch;
  readiness-gate mode: pods/status patch, and no pods patch anywhere but its own namespace);
- in the aggregator's own namespace (a Role): the Lease, and the leader label on its own pods
  (the calls aggregator/leader/own_pods.py makes);
- the DaemonSet agent: pods list and watch, cluster-wide or per Ray namespace (and its fallback
  writes, per mode: tests/deploy/test_agent_rbac.py).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from aggregator.kube.api import KubeApi
from servehealth_common.kube.client import KubeClient
from tests.deploy.manifests import ROOT, find, render, settings

Permission = tuple[str, str, str]  # (API group, resource, verb); "" is the core group

# Public methods that make no API call.
NO_API_CALL = {"close", "drain"}
# Calls of the shared client only agents make: never granted to the aggregator.
AGENT_ONLY = {"watch_lease"}
# Each public method that calls the API, and what it needs.
CALLS: dict[str, set[Permission]] = {
    # KubeClient: discovery (the aggregator) and the pods of a node (the DaemonSet agent).
    "list_pods": {("", "pods", "list")},
    "watch_pods": {("", "pods", "watch")},
    # KubeApi: the aggregator's writes, and the re-read after a conflict.
    "get_pod": {("", "pods", "get")},
    "patch_pod": {("", "pods", "patch")},
    "patch_pod_status": {("", "pods/status", "patch")},
    "create_event": {("", "events", "create")},
    # KubeApi: agent authentication (--auth tokenreview); tokenreviews are cluster-scoped.
    "review_token": {("authentication.k8s.io", "tokenreviews", "create")},
    # KubeApi: leader election (--leader-elect), one Lease in the aggregator's own namespace.
    "get_lease": {("coordination.k8s.io", "leases", "get")},
    "create_lease": {("coordination.k8s.io", "leases", "create")},
    "replace_lease": {("coordination.k8s.io", "leases", "update")},
    # KubeClient: the agents' read of that Lease while they have no stream (issue 26).
    "watch_lease": {("coordination.k8s.io", "leases", "watch")},
}
# Resources the aggregator uses only in its own namespace: granted by a Role there (least
# privilege), not by the ClusterRole.
OWN_NAMESPACE = {("coordination.k8s.io", "leases")}
AGGREGATOR = "ray-serve-health-aggregator"
# The client attributes holding kubernetes.client API objects: attribute -> (API group, class).
API_OBJECTS: dict[str, tuple[str, str]] = {
    "core": ("", "CoreV1Api"),
    "authentication": ("authentication.k8s.io", "AuthenticationV1Api"),
    "coordination": ("coordination.k8s.io", "CoordinationV1Api"),
}
# The modules allowed to touch the client's API objects.
API_MODULES = {
    Path("servehealth_common/kube/client.py"),
    Path("aggregator/kube/api.py"),
}
SOURCES = ["aggregator", "node_agent", "servehealth_common"]
# Building a kubernetes.client API object (CoreV1Api, CustomObjectsApi, ...; not our KubeApi).
API_OBJECT = r"\b(?!KubeApi\b)[A-Z]\w*Api\("
# An API call through one of those attributes (the aggregator's Core has other methods).
API_CALL = rf"\.(?:{'|'.join(API_OBJECTS)})\.(?:list|read|patch|create|replace|delete|connect)_\w+"
VERBS = {"read": "get", "list": "list", "patch": "patch", "create": "create", "replace": "update"}
VERBS_NOT_USED = {"delete": "delete", "connect": "connect"}


def public_methods(cls: type) -> set[str]:
    return {
        name
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member)
    }


def needed(cls: type) -> set[Permission]:
    names = public_methods(cls) - NO_API_CALL - AGENT_ONLY
    return set().union(*(CALLS[name] for name in names))


def derived(method: object) -> set[Permission]:
    """Permissions read off a method's ``self.<api>.<call>`` names (``API_OBJECTS``):
    ``core.read_namespaced_pod`` is pods get, ``core.patch_namespaced_pod_status`` pods/status
    patch, ``authentication.create_token_review`` tokenreviews create in authentication.k8s.io,
    and a ``list_*`` call becomes a watch when the method passes ``watch=True``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))  # type: ignore[arg-type]
    watches = any(
        (isinstance(node, ast.keyword) and node.arg == "watch")
        or (
            isinstance(node, ast.Dict)
            and any(isinstance(key, ast.Constant) and key.value == "watch" for key in node.keys)
        )
        for node in ast.walk(tree)
    )
    found = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in API_OBJECTS
        ):
            continue
        group = API_OBJECTS[node.value.attr][0]
        match = re.fullmatch(
            r"(?P<verb>[a-z]+)_(?:namespaced_)?(?P<kind>[a-z_]+?)(?P<all>_for_all_namespaces)?",
            node.attr,
        )
        assert match, f"unexpected API call {node.value.attr}.{node.attr}"
        verb = match["verb"]
        assert verb in VERBS, f"{node.attr}: verb {verb!r} ({VERBS_NOT_USED.get(verb)}) not tabled"
        kind = match["kind"]
        subresource = ""
        if kind.endswith("_status"):
            kind, subresource = kind.removesuffix("_status"), "/status"
        resource = kind.replace("_", "") + "s" + subresource  # token_review: tokenreviews
        found.add((group, resource, "watch" if verb == "list" and watches else VERBS[verb]))
    return found


# What each mode writes (--mode): the other mode's write is not granted.
WRITES: dict[str, set[str]] = {"label": {"patch_pod"}, "condition": {"patch_pod_status"}}
# The installations, and the mode their settings ConfigMap names.
INSTALLS = {
    "deploy/overlays/label-mode": "label",
    "deploy/overlays/readiness-gate-mode": "condition",
    "deploy/overlays/shadow-mode": "label",
    "deploy/overlays/namespaced": "condition",
    "deploy/examples/production": "condition",
    "deploy/examples/tls-secret": "label",
}
NAMESPACED = {"deploy/overlays/namespaced": ("ray",)}
AGENT = "ray-serve-health-agent"
# The leader label (--leader-label) on the aggregator's own pods: the calls of
# aggregator/leader/own_pods.py, and pods get (the interface the Role was specified with).
OWN_PODS = ROOT / "aggregator" / "leader" / "own_pods.py"
OWN_POD_VERBS_ALLOWED = {("", "pods", "get"), ("", "pods", "list"), ("", "pods", "patch")}
ALL = "*"  # the scope of a ClusterRoleBinding


def own_pod_calls() -> set[Permission]:
    """Permissions of the ``self._api.<method>`` calls in aggregator/leader/own_pods.py."""
    methods = set(re.findall(r"self\._api\.(\w+)\(", OWN_PODS.read_text()))
    assert methods, "own_pods.py calls no API method"
    return set().union(*(CALLS[name] for name in methods))


def cluster_calls(mode: str | None) -> set[Permission]:
    """What the aggregator calls on Ray pods' namespaces (and tokenreviews) in ``mode``: every
    call but the writes of the other modes (None: no write at all, deploy/base/aggregator)."""
    writes = set().union(*WRITES.values())
    wanted = writes if mode == "both" else WRITES.get(mode or "", set())
    methods = public_methods(KubeApi) - NO_API_CALL - (writes - wanted)
    calls = set().union(*(CALLS[name] for name in methods))
    return {p for p in calls if (p[0], p[1]) not in OWN_NAMESPACE}


def rules_of(role: dict) -> set[Permission]:
    permissions = set()
    for rule in role["rules"]:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
        # Only the agents' read of the aggregator's Lease names its object (issue 26).
        assert not rule.get("resourceNames") or rule["resources"] == ["leases"], rule
        assert not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                permissions |= {(group, resource, verb) for verb in rule["verbs"]}
    return permissions


def grants(objects: list[dict], account: str) -> dict[str, set[Permission]]:
    """What the ServiceAccount ``account`` (in the aggregator's namespace) is granted, by scope:
    ``ALL`` for ClusterRoleBindings, else the RoleBinding's namespace. Every binding that names
    it names it alone, in the aggregator's namespace."""
    account_namespace = find(objects, "ServiceAccount", account)["metadata"].get("namespace")
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o["kind"] in {"Role", "ClusterRole"}
    }
    found: dict[str, set[Permission]] = {}
    for binding in objects:
        if binding["kind"] not in {"RoleBinding", "ClusterRoleBinding"}:
            continue
        subjects = [(s["kind"], s["name"], s.get("namespace")) for s in binding["subjects"]]
        if not any(name == account for _, name, _ in subjects):
            continue
        assert subjects == [("ServiceAccount", account, account_namespace or "default")], subjects
        scope = binding["metadata"].get(
            "namespace", ALL if binding["kind"] == "ClusterRoleBinding" else None
        )
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        role_namespace = (
            None if ref["kind"] == "ClusterRole" else binding["metadata"].get("namespace")
        )
        role = roles.get((ref["kind"], role_namespace, ref["name"]))
        assert role is not None, f"{binding['metadata']['name']}: no {ref['kind']} {ref['name']}"
        found.setdefault(scope, set()).update(rules_of(role))
    return found


def settings_mode(objects: list[dict]) -> str:
    return settings(objects)["SERVE_HEALTH_MODE"]


@pytest.mark.parametrize("cls", [KubeClient, KubeApi], ids=lambda c: c.__name__)
def test_every_public_method_is_in_the_table(cls: type) -> None:
    untabled = public_methods(cls) - NO_API_CALL - set(CALLS)
    assert not untabled, (
        f"{cls.__name__} has new public methods {sorted(untabled)}: add them to CALLS with the "
        "permissions they need, and those to the ClusterRole in deploy/"
    )


@pytest.mark.parametrize("name", sorted(CALLS))
def test_table_agrees_with_the_calls_the_method_makes(name: str) -> None:
    method = getattr(KubeApi, name)
    assert derived(method) == CALLS[name]


def test_methods_without_calls_make_none() -> None:
    for name in NO_API_CALL:
        assert derived(getattr(KubeApi, name)) == set(), name


def test_no_other_module_calls_the_api() -> None:
    """Only the two adapter modules build API objects or call through ``.core``."""
    offenders = []
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative in API_MODULES:
                continue
            text = path.read_text()
            for pattern in (API_OBJECT, r"\bApiClient\(", r"\bDynamicClient\(", API_CALL):
                offenders += [f"{relative}: {m}" for m in re.findall(pattern, text)]
    assert not offenders, offenders


def test_the_clients_build_only_the_tabled_api_objects() -> None:
    """``derived`` reads the calls of the API objects in ``API_OBJECTS``; another would need
    its own entry there (and its group's rules in the roles)."""
    text = (ROOT / "servehealth_common/kube/client.py").read_text()
    assert re.findall(API_OBJECT, text) == ["CoreV1Api(", "CoordinationV1Api("]
    tabled = {f"{name}(" for _, name in API_OBJECTS.values()}
    assert set(re.findall(API_OBJECT, (ROOT / "aggregator/kube/api.py").read_text())) <= tabled


def test_the_leader_label_calls_are_tabled() -> None:
    assert own_pod_calls() <= OWN_POD_VERBS_ALLOWED


def test_base_aggregator_grants_reads_and_its_own_namespace_only() -> None:
    objects = render("deploy/base/aggregator")
    namespace = find(objects, "ServiceAccount", AGGREGATOR)["metadata"].get("namespace")
    by_scope = grants(objects, AGGREGATOR)
    assert by_scope.pop(ALL) == cluster_calls(None)
    own = by_scope.pop(namespace)
    assert {p for p in own if (p[0], p[1]) in OWN_NAMESPACE} == {
        ("coordination.k8s.io", "leases", "get"),
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "update"),
    }
    assert not by_scope


@pytest.mark.parametrize("directory", sorted(INSTALLS))
def test_each_install_grants_exactly_what_its_mode_calls(directory: str) -> None:
    objects = render(directory)
    mode = INSTALLS[directory]
    assert settings_mode(objects) == mode
    namespace = find(objects, "ServiceAccount", AGGREGATOR)["metadata"]["namespace"]
    by_scope = grants(objects, AGGREGATOR)
    # Its own namespace: the Lease, and the leader label on its own pods.
    own = by_scope.pop(namespace)
    leases = {p for p in own if (p[0], p[1]) in OWN_NAMESPACE}
    assert leases == {p for p in needed(KubeApi) if (p[0], p[1]) in OWN_NAMESPACE}
    assert own_pod_calls() <= own - leases <= OWN_POD_VERBS_ALLOWED
    ray_namespaces = NAMESPACED.get(directory)
    if ray_namespaces is None:
        assert by_scope.pop(ALL) == cluster_calls(mode)
    else:
        # Only tokenreviews stays cluster-wide (no RoleBinding can grant them).
        assert by_scope.pop(ALL) == {("authentication.k8s.io", "tokenreviews", "create")}
        for ray_namespace in ray_namespaces:
            assert by_scope.pop(ray_namespace) == cluster_calls(mode) - {
                ("authentication.k8s.io", "tokenreviews", "create")
            }
    assert not by_scope, f"unexpected grants: {by_scope}"


@pytest.mark.parametrize(
    "directory", sorted(d for d, mode in INSTALLS.items() if mode == "condition")
)
def test_readiness_gate_mode_never_patches_ray_pods(directory: str) -> None:
    """pods patch could rewrite any pod's spec: in readiness-gate mode the aggregator has it in
    its own namespace only (the leader label), nowhere else."""
    objects = render(directory)
    namespace = find(objects, "ServiceAccount", AGGREGATOR)["metadata"]["namespace"]
    for scope, permissions in grants(objects, AGGREGATOR).items():
        if scope != namespace:
            assert ("", "pods", "patch") not in permissions, scope


# What the DaemonSet agent calls while an aggregator answers: its node's pods, listed and
# watched. Its writes when none answers (fallback) are granted per mode by components:
# tests/deploy/test_agent_rbac.py.
AGENT_READS: set[Permission] = CALLS["list_pods"] | CALLS["watch_pods"]
READ_PODS = {("", "pods", "list"), ("", "pods", "watch")}


def test_agent_role_is_exactly_what_its_pod_watch_calls() -> None:
    objects = render("deploy/base/agent-daemonset")
    assert grants(objects, AGENT) == {ALL: AGENT_READS}
    assert READ_PODS == AGENT_READS


@pytest.mark.parametrize("directory", sorted(d for d in INSTALLS if "examples" not in d))
def test_agents_read_pods_cluster_wide_or_per_ray_namespace(directory: str) -> None:
    objects = render(directory)
    by_scope = grants(objects, AGENT)
    scopes = NAMESPACED.get(directory, (ALL,))
    # Where agents may fall back, they read the aggregator's Lease in its namespace too
    # (tests/deploy/test_agent_rbac.py).
    own = find(objects, "ServiceAccount", AGGREGATOR)["metadata"]["namespace"]
    leases = by_scope.pop(own, set())
    assert {p[1] for p in leases} <= {"leases"}
    assert set(by_scope) == set(scopes)
    assert all(by_scope[scope] >= AGENT_READS for scope in scopes)
