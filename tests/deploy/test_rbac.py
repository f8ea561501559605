"""The RBAC rules in deploy/ grant exactly what the code calls, no more and no less.

All Kubernetes API calls go through two classes: ``KubeClient`` (servehealth_common/kube/client.py,
the reads: all the DaemonSet agent may do) and its subclass ``KubeApi`` (aggregator/kube/api.py,
the aggregator's writes and token reviews on top). The table below names each of their public
methods and the permissions it needs. The tests check that the table covers every public method
(a new one fails until it is added), that each method's ``self.<api>.<call>`` (``api`` one of
``API_OBJECTS``: ``core`` is CoreV1Api, ...) agrees with the permissions the table gives it,
that nothing else in the code calls the API, and that each ClusterRole is exactly the union for
its component.
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
from tests.deploy.manifests import ROOT, find, render

Permission = tuple[str, str, str]  # (API group, resource, verb); "" is the core group

# Public methods that make no API call.
NO_API_CALL = {"close", "drain"}
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
    return set().union(*(CALLS[name] for name in public_methods(cls) - NO_API_CALL))


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


def split(permissions: set[Permission]) -> tuple[set[Permission], set[Permission]]:
    """(cluster-wide, own namespace) parts of ``permissions``, see ``OWN_NAMESPACE``."""
    own = {p for p in permissions if (p[0], p[1]) in OWN_NAMESPACE}
    return permissions - own, own


def rules_of(role: dict) -> set[Permission]:
    permissions = set()
    for rule in role["rules"]:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
        assert not rule.get("resourceNames"), rule
        assert not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                permissions |= {(group, resource, verb) for verb in rule["verbs"]}
    return permissions


def bound(objects: list[dict], kind: str, name: str) -> dict:
    """The (Cluster)Role ``name``, after checking that a binding of the same name gives it to
    the ServiceAccount ``name`` and nobody else."""
    role = find(objects, kind, name)
    binding = find(objects, f"{kind}Binding", name)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": kind,
        "name": name,
    }
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", name)]
    return role


def granted(directory: str, name: str) -> set[Permission]:
    """What the ClusterRole ``name`` grants (cluster-wide)."""
    return rules_of(bound(render(directory), "ClusterRole", name))


def granted_in_own_namespace(directory: str, name: str) -> set[Permission]:
    """What the Role ``name`` grants in its namespace (none: no Role). Only the aggregator
    has a Role, and it lives where the aggregator (its ServiceAccount) does."""
    objects = render(directory)
    namespaced = [o for o in objects if o["kind"] in {"Role", "RoleBinding"}]
    assert {o["metadata"]["name"] for o in namespaced} <= {AGGREGATOR}, "unexpected Role"
    if not any(o["kind"] == "Role" and o["metadata"]["name"] == name for o in objects):
        return set()
    role = bound(objects, "Role", name)
    binding = find(objects, "RoleBinding", name)
    account = find(objects, "ServiceAccount", name)
    namespace = account["metadata"].get("namespace")
    assert role["metadata"].get("namespace") == binding["metadata"].get("namespace") == namespace
    if namespace:  # an overlay's: the subject is the ServiceAccount in that same namespace
        assert binding["subjects"][0].get("namespace") == namespace
    return rules_of(role)


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
    assert re.findall(API_OBJECT, text) == ["CoreV1Api("]
    tabled = {f"{name}(" for _, name in API_OBJECTS.values()}
    assert set(re.findall(API_OBJECT, (ROOT / "aggregator/kube/api.py").read_text())) <= tabled


def test_aggregator_role_is_exactly_what_its_code_calls() -> None:
    cluster, own = split(needed(KubeApi))
    assert own == {
        ("coordination.k8s.io", "leases", "get"),
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "update"),
    }
    assert granted("deploy/base/aggregator", AGGREGATOR) == cluster
    assert granted_in_own_namespace("deploy/base/aggregator", AGGREGATOR) == own


def test_agent_role_is_exactly_what_its_client_calls() -> None:
    permissions = granted("deploy/base/agent-daemonset", "ray-serve-health-agent")
    assert permissions == needed(KubeClient) == {("", "pods", "list"), ("", "pods", "watch")}
    assert (
        granted_in_own_namespace("deploy/base/agent-daemonset", "ray-serve-health-agent") == set()
    )


@pytest.mark.parametrize(
    "directory", ["deploy/overlays/label-mode", "deploy/overlays/readiness-gate-mode"]
)
def test_overlays_keep_the_roles(directory: str) -> None:
    cluster, own = split(needed(KubeApi))
    assert granted(directory, AGGREGATOR) == cluster
    assert granted_in_own_namespace(directory, AGGREGATOR) == own
    assert granted(directory, "ray-serve-health-agent") == needed(KubeClient)
    assert granted_in_own_namespace(directory, "ray-serve-health-agent") == set()
