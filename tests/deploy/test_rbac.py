"""The RBAC rules in deploy/ grant exactly what the code calls, no more and no less.

All Kubernetes API calls go through two classes: ``KubeClient`` (servehealth_common/kube/client.py,
the reads: all the DaemonSet agent may do) and its subclass ``KubeApi`` (aggregator/kube/api.py,
the aggregator's writes on top). The table below names each of their public methods and the
permissions it needs. The tests check that the table covers every public method (a new one
fails until it is added), that each method's ``self.core.<call>`` agrees with the permissions
the table gives it, that nothing else in the code calls the API, and that each ClusterRole is
exactly the union for its component.
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
NO_API_CALL = {"close"}
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
}
# The modules allowed to touch the client's API objects.
API_MODULES = {
    Path("servehealth_common/kube/client.py"),
    Path("aggregator/kube/api.py"),
}
SOURCES = ["aggregator", "node_agent", "servehealth_common"]
# Building a kubernetes.client API object (CoreV1Api, CustomObjectsApi, ...; not our KubeApi).
API_OBJECT = r"\b(?!KubeApi\b)[A-Z]\w*Api\("
# A CoreV1Api call through a ``core`` attribute (the aggregator's Core has other methods).
CORE_CALL = r"\.core\.(?:list|read|patch|create|replace|delete|connect)_\w+"
VERBS = {"read": "get", "list": "list", "patch": "patch", "create": "create"}
VERBS_NOT_USED = {"replace": "update", "delete": "delete", "connect": "connect"}


def public_methods(cls: type) -> set[str]:
    return {
        name
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member)
    }


def needed(cls: type) -> set[Permission]:
    return set().union(*(CALLS[name] for name in public_methods(cls) - NO_API_CALL))


def derived(method: object) -> set[Permission]:
    """Permissions read off a method's ``self.core.<call>`` names (kubernetes.client.CoreV1Api):
    ``read_namespaced_pod`` is pods get, ``patch_namespaced_pod_status`` pods/status patch, and
    a ``list_*`` call becomes a watch when the method passes ``watch=True``."""
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
            and node.value.attr == "core"
        ):
            continue
        match = re.fullmatch(
            r"(?P<verb>[a-z]+)_(?:namespaced_)?(?P<kind>[a-z_]+?)(?P<all>_for_all_namespaces)?",
            node.attr,
        )
        assert match, f"unexpected CoreV1Api call {node.attr}"
        verb = match["verb"]
        assert verb in VERBS, f"{node.attr}: verb {verb!r} ({VERBS_NOT_USED.get(verb)}) not tabled"
        kind = match["kind"]
        subresource = ""
        if kind.endswith("_status"):
            kind, subresource = kind.removesuffix("_status"), "/status"
        resource = kind + "s" + subresource
        found.add(("", resource, "watch" if verb == "list" and watches else VERBS[verb]))
    return found


def granted(directory: str, name: str) -> set[Permission]:
    objects = render(directory)
    role = find(objects, "ClusterRole", name)
    permissions = set()
    for rule in role["rules"]:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
        assert not rule.get("resourceNames"), rule
        assert not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                permissions |= {(group, resource, verb) for verb in rule["verbs"]}
    binding = find(objects, "ClusterRoleBinding", name)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": name,
    }
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", name)]
    assert not any(o["kind"] in {"Role", "RoleBinding"} for o in objects), "unexpected Role"
    return permissions


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
            for pattern in (API_OBJECT, r"\bApiClient\(", r"\bDynamicClient\(", CORE_CALL):
                offenders += [f"{relative}: {m}" for m in re.findall(pattern, text)]
    assert not offenders, offenders


def test_the_client_builds_only_the_core_api() -> None:
    """``derived`` reads CoreV1Api names; another API object would need its own reading."""
    text = (ROOT / "servehealth_common/kube/client.py").read_text()
    assert re.findall(API_OBJECT, text) == ["CoreV1Api("]
    assert not re.findall(API_OBJECT, (ROOT / "aggregator/kube/api.py").read_text())


def test_aggregator_role_is_exactly_what_its_code_calls() -> None:
    assert granted("deploy/base/aggregator", "ray-serve-health-aggregator") == needed(KubeApi)


def test_agent_role_is_exactly_what_its_client_calls() -> None:
    permissions = granted("deploy/base/agent-daemonset", "ray-serve-health-agent")
    assert permissions == needed(KubeClient) == {("", "pods", "list"), ("", "pods", "watch")}


@pytest.mark.parametrize(
    "directory", ["deploy/overlays/label-mode", "deploy/overlays/readiness-gate-mode"]
)
def test_overlays_keep_the_roles(directory: str) -> None:
    assert granted(directory, "ray-serve-health-aggregator") == needed(KubeApi)
    assert granted(directory, "ray-serve-health-agent") == needed(KubeClient)
