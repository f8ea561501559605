"""deploy/'s two ValidatingAdmissionPolicies match every pod (and Event) request in the cluster
and fail closed (``failurePolicy: Fail``), so they must never touch anyone else's request: not
by an error, not by a missing or edited ConfigMap, not by a bug in a rule.

- The match conditions compare ``request.userInfo.username`` with constants kustomize writes in
  (the namespace of the aggregator's ServiceAccount; the sidecar accounts of the settings), and
  read nothing else: for any other user they are false, never an error, with nothing bound.
- The policies have no parameters (no ``paramKind``, no ``paramRef``): the API server resolves a
  binding's parameters before it evaluates the match conditions
  (k8s.io/apiserver/pkg/admission/plugin/policy/generic/policy_dispatcher.go, CollectParams),
  so a ConfigMap that is missing (``parameterNotFoundAction: Deny``), or not yet in the API
  server's informer ("not yet synced"), refuses every request the binding matches, the
  kubelets' and the controllers' included; and with ``Allow`` a deleted ConfigMap turns the
  guard off. Without parameters neither can happen, and a ConfigMap that someone edits cannot
  widen a policy to another account (listing ``system:serviceaccount:ray:default`` as a sidecar
  in the live ConfigMap used to restrict every request of that account).
- Kustomize writes the constants from the overlay that is applied: a user's overlay in another
  namespace, with its own sidecars (tests/deploy/fixtures/sidecars-elsewhere), gets policies for
  its accounts and nobody else's.

Every expression is evaluated by cel-python and by cel-cpp (tests/deploy/cel_policy.py)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from lark import Tree

from tests.deploy.cel_engines import CelError
from tests.deploy.cel_policy import Policy
from tests.deploy.manifests import ROOT, find, kustomize, render, settings_configmap

AGGREGATOR_POLICY, AGENT_POLICY = "ray-serve-health-aggregator", "ray-serve-health-agent"
POLICIES = [AGGREGATOR_POLICY, AGENT_POLICY]
INSTALLS = [
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/overlays/shadow-mode",
    "deploy/overlays/namespaced",
    "deploy/examples/production",
    "deploy/examples/tls-secret",
    "deploy/examples/monitoring",
    "deploy/examples/label-mode-fallback",
    "deploy/examples/both-mode",
]
FIXTURE = "tests/deploy/fixtures/sidecars-elsewhere"
SIDECARS = ["system:serviceaccount:ray:rayservice-sample", "system:serviceaccount:team-b:serve"]

# Everyone who is not ours: kubelets, controllers, users, the operator, the same account names
# in another namespace, an account a user might list by mistake, names built to fool a match
# on a comma-separated list.
FOREIGN = [
    "system:node:n1",
    "system:node:node-a",
    "alice",
    "alice@example.com",
    "system:anonymous",
    "system:kube-controller-manager",
    "system:kube-scheduler",
    "system:serviceaccount:kube-system:replicaset-controller",
    "system:serviceaccount:kube-system:node-controller",
    "system:serviceaccount:kuberay:kuberay-operator",
    "system:serviceaccount:ray:default",
    "system:serviceaccount:ray-serve-health:default",
    "system:serviceaccount:other:ray-serve-health-aggregator",
    "system:serviceaccount:other:ray-serve-health-agent",
    "system:serviceaccount:ray:rayservice-sample-2",
    "system:serviceaccount:ray:rayservice",
    "serviceaccount:ray:rayservice-sample",
    "system:serviceaccount:ray:rayservice-sample,system:serviceaccount:team-b:serve",
    "",
]


@functools.cache
def objects(directory: str) -> list[dict[str, Any]]:
    if directory.startswith("tests/"):
        return [doc for doc in yaml.safe_load_all(kustomize(ROOT / directory)) if doc]
    return render(directory)


@functools.cache
def policy(directory: str, name: str) -> Policy:
    return Policy(find(objects(directory), "ValidatingAdmissionPolicy", name))


def namespace_of_install(directory: str) -> str:
    account = find(objects(directory), "ServiceAccount", "ray-serve-health-aggregator")
    return account["metadata"]["namespace"]


def ours(directory: str, name: str) -> list[str]:
    """The accounts a policy of this install is for."""
    namespace = namespace_of_install(directory)
    if name == AGGREGATOR_POLICY:
        return [f"system:serviceaccount:{namespace}:ray-serve-health-aggregator"]
    listed = SIDECARS if directory == FIXTURE else []
    return [f"system:serviceaccount:{namespace}:ray-serve-health-agent", *listed]


def pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "worker-1",
            "namespace": "ray",
            "uid": "u-1",
            "labels": {"ray.io/node-type": "worker"},
            "managedFields": [],
        },
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def request(user: str, operation: str = "UPDATE", sub: str = "status", resource: str = "pods"):
    return {
        "operation": operation,
        "subResource": sub,
        "resource": {"group": "", "version": "v1", "resource": resource},
        "userInfo": {"username": user, "groups": ["system:authenticated"], "extra": {}},
        "namespace": "ray",
        "name": "worker-1",
    }


def shapes(user: str) -> list[tuple[dict[str, Any], Any, Any]]:
    """A kubelet's status update, an image change, a delete (no object), an Event."""
    changed = copy.deepcopy(pod())
    changed["spec"]["containers"][0]["image"] = "other"
    return [
        (request(user), pod(), pod()),
        (request(user, sub=""), changed, pod()),
        (request(user, "DELETE", ""), None, pod()),
        (request(user, "CREATE", "", "events"), {"kind": "Event", "reason": "Pulled"}, None),
    ]


CASES = [pytest.param(d, n, id=f"{d}:{n}") for d in [*INSTALLS, FIXTURE] for n in POLICIES]


# -- what the match conditions read -------------------------------------------------------


def references(tree: Any, found: set[str]) -> set[str]:
    """The names and field paths (request.userInfo.username) an expression reads."""
    if not isinstance(tree, Tree):
        return found
    if tree.data == "member_dot":
        path = chain(tree)
        if path is not None:
            found.add(path)
            return found
    if tree.data == "ident":
        found.add(str(tree.children[0]))
    for child in tree.children:
        references(child, found)
    return found


def chain(tree: Any) -> str | None:
    while isinstance(tree, Tree) and tree.data in {"member", "primary"} and len(tree.children) == 1:
        tree = tree.children[0]
    if isinstance(tree, Tree) and tree.data == "ident":
        return str(tree.children[0])
    if isinstance(tree, Tree) and tree.data == "member_dot":
        head = chain(tree.children[0])
        return None if head is None else f"{head}.{tree.children[1]}"
    return None


@pytest.mark.parametrize(("directory", "name"), CASES)
def test_match_conditions_read_the_username_and_constants_only(directory: str, name: str) -> None:
    vap = find(objects(directory), "ValidatingAdmissionPolicy", name)
    env = celpy.Environment()
    read: set[str] = set()
    for condition in vap["spec"]["matchConditions"]:
        references(env.compile(condition["expression"]), read)
    assert read <= {"request.userInfo.username", "request.userInfo.groups"}, sorted(read)


@pytest.mark.parametrize(("directory", "name"), CASES)
def test_foreign_requests_are_never_matched_and_never_fail(directory: str, name: str) -> None:
    """False, not an error, in both implementations, with nothing bound to params: whatever
    happens to a ConfigMap, a kubelet's status update is not the policy's business."""
    failures = []
    for user in FOREIGN:
        for req, obj, old in shapes(user):
            for results in policy(directory, name).conditions(req, obj, old):
                if any(isinstance(r, CelError) or not isinstance(r, bool) for r in results):
                    failures.append(f"{user!r} {req['operation']}: {results}")
                elif all(results):
                    failures.append(f"{user!r} {req['operation']}: matched")
    assert failures == []


@pytest.mark.parametrize(("directory", "name"), CASES)
def test_our_accounts_are_matched(directory: str, name: str) -> None:
    for user in ours(directory, name):
        for req, obj, old in shapes(user):
            for results in policy(directory, name).conditions(req, obj, old):
                assert results, user
                assert all(r is True for r in results), (user, results)


@pytest.mark.parametrize("directory", [*INSTALLS, FIXTURE])
def test_the_policies_have_no_parameters_to_lose(directory: str) -> None:
    """No paramKind, no paramRef: the guard does not depend on a ConfigMap that can be deleted
    (Allow: off) or be missing from the API server's cache (Deny, or not yet synced: every pod
    request in the cluster refused)."""
    for name in POLICIES:
        vap = find(objects(directory), "ValidatingAdmissionPolicy", name)
        binding = find(objects(directory), "ValidatingAdmissionPolicyBinding", name)
        assert "paramKind" not in vap["spec"], name
        assert "paramRef" not in binding["spec"], name
        assert vap["spec"]["failurePolicy"] == "Fail"
        assert binding["spec"]["validationActions"] == ["Deny"]


@pytest.mark.parametrize("directory", [*INSTALLS, FIXTURE])
def test_an_edited_configmap_cannot_widen_the_policies(directory: str) -> None:
    """Someone lists the namespace's default account (and a kubelet) as sidecars in the live
    settings ConfigMap: neither policy applies to them. Bound as the API server would bind it
    if a policy still had a paramKind."""
    edited = copy.deepcopy(settings_configmap(objects(directory)))
    edited["data"]["SIDECAR_AGENT_SERVICE_ACCOUNTS"] = ",".join(
        ["system:serviceaccount:ray:default", "system:node:n1", *SIDECARS]
    )
    for name in POLICIES:
        for user in ("system:serviceaccount:ray:default", "system:node:n1"):
            for req, obj, old in shapes(user):
                verdict = policy(directory, name).admit(req, obj, old, params=edited)
                assert not verdict.matched, (name, user, req["operation"])


@pytest.mark.parametrize(("directory", "name"), CASES)
def test_our_requests_are_judged_without_parameters(directory: str, name: str) -> None:
    """With nothing bound to params (a ConfigMap deleted, or never there), our own accounts'
    requests are still judged: matched, no expression fails, the rules hold."""
    for user in ours(directory, name):
        changed = copy.deepcopy(pod())
        changed["spec"]["containers"][0]["image"] = "attacker/miner:latest"
        verdict = policy(directory, name).admit(request(user, sub=""), changed, pod())
        assert verdict.matched
        assert verdict.refusals
        assert not any(r.startswith("error: ") for r in verdict.refusals), verdict.refusals


def test_a_user_overlay_gets_policies_for_its_own_accounts() -> None:
    """tests/deploy/fixtures/sidecars-elsewhere: namespace platform, two sidecars listed in its
    configMapGenerator. Its policies apply to platform's aggregator and agent and to the two
    sidecars; the accounts of the default namespace are nobody's here."""
    assert namespace_of_install(FIXTURE) == "platform"
    for name in POLICIES:
        vap = find(objects(FIXTURE), "ValidatingAdmissionPolicy", name)
        text = yaml.safe_dump(vap["spec"])
        assert "$(" not in text  # every constant written in
        assert "system:serviceaccount:ray-serve-health:" not in text
        for user in (
            "system:serviceaccount:ray-serve-health:ray-serve-health-aggregator",
            "system:serviceaccount:ray-serve-health:ray-serve-health-agent",
        ):
            (results, *_) = policy(FIXTURE, name).conditions(request(user), pod(), pod())
            assert False in results, (name, user)


def test_install_docs_say_who_may_edit_the_settings() -> None:
    text = (Path(ROOT) / "docs" / "install.md").read_text()
    assert "Who may edit the settings ConfigMap" in text
