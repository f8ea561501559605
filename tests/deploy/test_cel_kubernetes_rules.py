"""Every CEL expression of every ValidatingAdmissionPolicy that deploy/ renders, held to what the
API server does and no CEL library knows (tests/deploy/cel_kubernetes.py): no reserved word
(``namespace``, ``in``, ``as``, ..., ``true``, ``false``, ``null``) and no escaped name
(``__namespace__``, ``__dot__``, ...) as a field name of an object, ``has()`` only on fields
(``in`` for the keys of a map), only the declared fields of the typed ``request``, nothing
undeclared (``params`` without a paramKind); and compiled by two independent implementations
(cel-python and Google's cel-cpp), then evaluated by both on every kind of request the policies
match, ``object`` null on a DELETE and ``oldObject`` null on a CREATE or CONNECT as the API
server sets them, without a single error.

The walker's own table (test_the_rules_catch_what_they_are_for) shows it is not vacuous: each
rule has an expression that breaks it, and the usual way round it passes."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.cel_engines import DECLARED, CelCpp, CompileError, engines
from tests.deploy.cel_kubernetes import check_expression, expressions, violations
from tests.deploy.cel_policy import Policy
from tests.deploy.manifests import ROOT, kustomize, render, renderable

FIXTURES = Path(__file__).parent / "fixtures"
SIDECARS = FIXTURES / "sidecars-elsewhere"


@functools.cache
def rendered(directory: str) -> list[dict[str, Any]]:
    if directory.startswith("tests/"):
        import yaml

        return [doc for doc in yaml.safe_load_all(kustomize(ROOT / directory)) if doc]
    return render(directory)


@functools.cache
def policies() -> list[tuple[str, str]]:
    """(directory, policy name) of every policy every kustomization renders, and the user
    overlay of tests/deploy/fixtures/sidecars-elsewhere (another namespace, sidecars listed)."""
    directories = [str(d) for d in renderable()] + [str(SIDECARS.relative_to(ROOT))]
    return [
        (directory, obj["metadata"]["name"])
        for directory in directories
        for obj in rendered(directory)
        if obj["kind"] == "ValidatingAdmissionPolicy"
    ]


def policy_of(directory: str, name: str) -> dict[str, Any]:
    (found,) = [
        obj
        for obj in rendered(directory)
        if obj["kind"] == "ValidatingAdmissionPolicy" and obj["metadata"]["name"] == name
    ]
    return found


CASES = [pytest.param(d, n, id=f"{d}:{n}") for d, n in policies()]


def test_there_are_policies_to_check() -> None:
    names = {name for _, name in policies()}
    assert names == {"ray-serve-health-aggregator", "ray-serve-health-agent"}


@pytest.mark.parametrize(("directory", "name"), CASES)
def test_every_expression_keeps_the_rules_of_kubernetes(directory: str, name: str) -> None:
    assert violations(policy_of(directory, name)) == []


@pytest.mark.parametrize(("directory", "name"), CASES)
def test_both_cel_implementations_compile_every_expression(directory: str, name: str) -> None:
    policy = policy_of(directory, name)
    names = DECLARED + (("params",) if policy["spec"].get("paramKind") else ())
    failures = []
    for engine in engines(names):
        for where, text in expressions(policy):
            try:
                engine.compile(text)
            except CompileError as error:
                failures.append(f"{where}: {error}")
    assert failures == []


# -- every kind of request, with what object and oldObject are then ---------------------


def pod(name: str = "worker-1", node: str = "node-a") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ray",
            "uid": "7f1c0e52-0000-4000-8000-000000000001",
            "resourceVersion": "1001",
            "labels": {"ray.io/node-type": "worker", "ray.io/serve": "true"},
            "annotations": {"ray.io/ft-enabled": "false"},
            "managedFields": [{"manager": "kuberay-operator", "operation": "Update"}],
        },
        "spec": {"nodeName": node, "containers": [{"name": "ray-worker", "image": "ray:2"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "ray.io/serve-proxy-healthy", "status": "True"}],
        },
    }


def event() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "worker-1.1880f5a2c3d4e5f6", "namespace": "ray"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": "ray", "name": "x"},
        "reason": "NoAggregator",
        "message": "m",
        "type": "Warning",
    }


def flipped(obj: dict[str, Any]) -> dict[str, Any]:
    new = copy.deepcopy(obj)
    new["metadata"].setdefault("labels", {})["ray.io/serve"] = "false"
    return new


# (resource, subresource, operation, object, oldObject): what the API server passes.
REQUESTS = [
    ("pods", "", "UPDATE", flipped(pod()), pod()),
    ("pods", "status", "UPDATE", pod(), pod()),
    ("pods", "", "CREATE", pod(), None),
    ("pods", "", "DELETE", None, pod()),
    ("pods", "eviction", "CREATE", {"apiVersion": "policy/v1", "kind": "Eviction"}, None),
    ("pods", "exec", "CONNECT", {"apiVersion": "v1", "kind": "PodExecOptions"}, None),
    ("pods", "ephemeralcontainers", "UPDATE", pod(), pod()),
    ("pods", "binding", "CREATE", {"apiVersion": "v1", "kind": "Binding"}, None),
    ("events", "", "CREATE", event(), None),
    ("events", "", "UPDATE", event(), event()),
    ("events", "", "DELETE", None, event()),
]


def our_accounts(directory: str) -> list[tuple[str, dict[str, list[str]]]]:
    """The accounts the install's policies are for, with a pod-bound token's extras."""
    objects = rendered(directory)
    found = []
    for obj in objects:
        if obj["kind"] == "ServiceAccount":
            namespace = obj["metadata"].get("namespace", "default")
            found.append(f"system:serviceaccount:{namespace}:{obj['metadata']['name']}")
    found += ["system:serviceaccount:ray:rayservice-sample"]  # listed in the fixture only
    extra = {
        "authentication.kubernetes.io/pod-name": ["worker-1"],
        "authentication.kubernetes.io/pod-uid": ["7f1c0e52-0000-4000-8000-000000000001"],
        "authentication.kubernetes.io/node-name": ["node-a"],
    }
    return [(user, extra) for user in found] + [(user, {}) for user in found]


def matched_by_rules(vap: dict[str, Any], resource: str, sub: str) -> bool:
    """Whether the policy's matchConstraints select requests on this (sub)resource."""
    wanted = {resource if not sub else f"{resource}/{sub}", f"{resource}/*" if sub else resource}
    return any(
        wanted & set(rule["resources"]) for rule in vap["spec"]["matchConstraints"]["resourceRules"]
    )


@pytest.mark.parametrize(("directory", "name"), CASES)
def test_no_expression_fails_on_any_kind_of_request(directory: str, name: str) -> None:
    """A failing expression refuses our own account's request (failurePolicy Fail): the
    expressions must hold up when object is null (DELETE), oldObject is null (CREATE,
    CONNECT), the object is not a pod (an Eviction, exec options, an Event), the token names
    no pod; with no parameters at all, as the API server evaluates a policy without
    paramKind."""
    vap = policy_of(directory, name)
    policy = Policy(vap)
    failures = []
    for user, extra in our_accounts(directory):
        for resource, sub, operation, obj, old in REQUESTS:
            if not matched_by_rules(vap, resource, sub):
                continue
            request = {
                "operation": operation,
                "subResource": sub,
                "resource": {"group": "", "version": "v1", "resource": resource},
                "userInfo": {"username": user, "groups": [], "extra": extra},
                "namespace": "ray",
                "name": "worker-1",
            }
            for error in policy.errors(request, obj, old):
                failures.append(f"{user} {operation} {resource}/{sub}: {error}")
    assert failures == []


# -- the walker itself --------------------------------------------------------------------

BROKEN = {
    # Reserved words as field names.
    "object.metadata.namespace == 'ray'": "reserved word",
    "has(object.metadata.namespace)": "reserved word",
    "object.involvedObject.namespace == request.namespace": "reserved word",
    # Escaped names: only where Kubernetes types the object.
    "object.metadata.__namespace__ == 'ray'": "escaped property name",
    "object.metadata['__namespace__'] == 'ray'": "escaped property name",
    # A name with '.', '-' or '/' escaped: the key of an untyped map is the name itself.
    "object.metadata.labels.ray__dot__io__slash__serve == 'true'": "escaped property name",
    "dyn(object.spec).node__dash__name == 'a'": "escaped property name",
    # has() on the free keys of a map (labels: 'ray.io/serve' could not even be written so).
    "has(object.metadata.labels.app)": "has() on a key",
    "has(request.userInfo.extra.scopes)": "has() on a key",
    # The typed request: only its fields, and no index syntax.
    "request.nmespace == 'ray'": "has no field",
    "request['namespace'] == 'ray'": "typed",
    # Objects: only their schema's properties.
    "object.spce == oldObject.spec": "has no property",
    # Nothing undeclared: no params without a paramKind.
    "params.data['x'] == 'y'": "not declared",
}
SOUND = [
    "request.namespace == 'ray'",
    "object.metadata['namespace'] == 'ray'",
    "dyn(object.involvedObject)['namespace'] == request.namespace",
    "'ray.io/serve' in object.metadata.labels",
    "object.metadata.labels['ray.io/serve'] == 'true'",
    "has(object.metadata.labels) && object.metadata.labels['ray.io/serve'] == 'true'",
    "'authentication.kubernetes.io/pod-name' in request.userInfo.extra",
    "has(object.spec.nodeName) && object.spec.nodeName == 'node-a'",
    "dyn(object.metadata).all(k, k in ['labels'] || dyn(object.metadata)[k] != null)",
    "object.status.conditions.all(c, c.type != 'Ready' || c.status == 'True')",
]


@pytest.mark.parametrize("expression", list(BROKEN))
def test_the_rules_catch_what_they_are_for(expression: str) -> None:
    found = check_expression(expression)
    assert any(BROKEN[expression] in message for message in found), found


@pytest.mark.parametrize("expression", SOUND)
def test_the_usual_ways_round_them_pass(expression: str) -> None:
    assert check_expression(expression) == []


def test_params_is_declared_only_with_a_paramkind() -> None:
    kind = {"paramKind": {"apiVersion": "v1", "kind": "ConfigMap"}}
    assert check_expression("params.data['x'] == 'y'", kind) == []


@pytest.mark.parametrize(
    "expression",
    ["object.metadata.in", "object.metadata.true", "object.null", "namespace == 'ray'"],
)
def test_keywords_and_reserved_identifiers_are_refused(expression: str) -> None:
    """A keyword is never a field name, a reserved word never an identifier. cel-cpp refuses
    them as the API server's cel-go does; cel-python 0.5 lets ``x.in``, ``x.null`` and a bare
    ``namespace`` through, which is why its answer alone is not enough: the walker refuses them
    too."""
    with pytest.raises(CompileError):
        CelCpp(DECLARED).compile(expression)
    assert check_expression(expression)
