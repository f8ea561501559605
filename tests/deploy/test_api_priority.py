"""deploy/components/api-priority (issue 28, point 9): API Priority and Fairness for the
aggregator's and the agents' ServiceAccounts, as deploy/examples/production renders it.

Checked: the objects render and are valid flowcontrol.apiserver.k8s.io/v1 (Kubernetes 1.29, the
first with v1, the oldest the docs support, the newest kubernetes-validate knows; 1.28 has no
v1); the FlowSchemas' subjects are the rendered ServiceAccounts, names and namespace, also when a
user's overlay moves everything to another namespace; their matchingPrecedence sits between the
built-ins so that ours win over service-accounts and global-default and lose to exempt and
system-leader-election; and a small classifier (the first matching FlowSchema, lowest
precedence first, as the API server picks) puts the aggregator's Lease renewals at
leader-election, its other requests and the agents' at our level, a sidecar account added with
docs/install.md's patch there too, and nobody else's request anywhere new.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import ROOT, find, render, render_written

PRODUCTION = "deploy/examples/production"
COMPONENT = ROOT / "deploy" / "components" / "api-priority"
INSTALL_DOC = ROOT / "docs" / "install.md"
NAMESPACE = "ray-serve-health"
AGGREGATOR_SA = "ray-serve-health-aggregator"
AGENT_SA = "ray-serve-health-agent"
LEVEL = "ray-serve-health"
LEASE_SCHEMA = "ray-serve-health-leader-election"

#: The built-in FlowSchemas' matchingPrecedence and priority level (Kubernetes 1.29 and newer:
#: the mandatory and suggested configuration, k8s.io/apiserver/pkg/apis/flowcontrol/bootstrap/
#: default.go; docs: concepts/cluster-administration/flow-control, "Defaults").
BUILTIN_PRECEDENCE = {
    "exempt": (1, "exempt"),
    "probes": (2, "exempt"),
    "system-leader-election": (100, "leader-election"),
    "endpoint-controller": (150, "workload-high"),
    "workload-leader-election": (200, "leader-election"),
    "system-node-high": (400, "node-high"),
    "system-nodes": (500, "system"),
    "kube-controller-manager": (800, "workload-high"),
    "kube-scheduler": (800, "workload-high"),
    "kube-system-service-accounts": (900, "workload-high"),
    "service-accounts": (9000, "workload-low"),
    "global-default": (9900, "global-default"),
    "catch-all": (10000, "catch-all"),
}
#: Ours must win over these ...
BELOW = ("service-accounts", "global-default", "catch-all")
#: ... and never over these.
ABOVE = ("exempt", "probes", "system-leader-election")


def ours(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "FlowSchema"]


@pytest.fixture(scope="module")
def production() -> list[dict[str, Any]]:
    return render(PRODUCTION)


# -- a classifier, as the API server's (enough for our rules) ---------------------------


@dataclass(frozen=True)
class Request:
    """Who asks what: a ServiceAccount (namespace, name) and a resource request."""

    namespace: str
    account: str
    verb: str
    group: str
    resource: str
    target_namespace: str  # "" for a cluster-scoped resource

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.account}"

    @property
    def groups(self) -> set[str]:
        return {
            "system:serviceaccounts",
            f"system:serviceaccounts:{self.namespace}",
            "system:authenticated",
        }


def subject_matches(subject: dict[str, Any], request: Request) -> bool:
    kind = subject["kind"]
    if kind == "ServiceAccount":
        account = subject["serviceAccount"]
        return account["namespace"] == request.namespace and account["name"] in (
            "*",
            request.account,
        )
    if kind == "User":
        return subject["user"]["name"] in ("*", request.username)
    assert kind == "Group", subject
    return subject["group"]["name"] in request.groups


def rule_matches(rule: dict[str, Any], request: Request) -> bool:
    def has(values: list[str], value: str) -> bool:
        return "*" in values or value in values

    if not (
        has(rule["verbs"], request.verb)
        and has(rule["apiGroups"], request.group)
        and has(rule["resources"], request.resource)
    ):
        return False
    if request.target_namespace:
        return has(rule.get("namespaces", []), request.target_namespace)
    return bool(rule.get("clusterScope"))


def schema_matches(schema: dict[str, Any], request: Request) -> bool:
    return any(
        any(subject_matches(s, request) for s in rules["subjects"])
        and any(rule_matches(r, request) for r in rules.get("resourceRules", []))
        for rules in schema["spec"].get("rules", [])
    )


def builtin_schemas() -> list[dict[str, Any]]:
    """The built-ins that can match a ServiceAccount's resource request outside kube-system."""
    everything = {
        "verbs": ["*"],
        "apiGroups": ["*"],
        "resources": ["*"],
        "namespaces": ["*"],
        "clusterScope": True,
    }

    def schema(name: str, subjects: list[dict[str, Any]]) -> dict[str, Any]:
        precedence, level = BUILTIN_PRECEDENCE[name]
        return {
            "metadata": {"name": name},
            "spec": {
                "matchingPrecedence": precedence,
                "priorityLevelConfiguration": {"name": level},
                "rules": [{"subjects": subjects, "resourceRules": [everything]}],
            },
        }

    return [
        schema("exempt", [{"kind": "Group", "group": {"name": "system:masters"}}]),
        schema(
            "service-accounts", [{"kind": "Group", "group": {"name": "system:serviceaccounts"}}]
        ),
        schema("global-default", [{"kind": "Group", "group": {"name": "system:authenticated"}}]),
    ]


def classify(schemas: list[dict[str, Any]], request: Request) -> tuple[str, str]:
    """(FlowSchema, priority level) the API server picks: lowest precedence, then name."""
    ordered = sorted(
        schemas, key=lambda s: (s["spec"]["matchingPrecedence"], s["metadata"]["name"])
    )
    for schema in ordered:
        if schema_matches(schema, request):
            return schema["metadata"]["name"], schema["spec"]["priorityLevelConfiguration"]["name"]
    raise AssertionError(f"nothing classifies {request}")


def aggregator(verb: str, group: str, resource: str, where: str, ns: str = NAMESPACE) -> Request:
    return Request(ns, AGGREGATOR_SA, verb, group, resource, where)


# -- rendering and schemas --------------------------------------------------------------


def test_production_renders_the_level_and_three_flow_schemas(
    production: list[dict[str, Any]],
) -> None:
    level = find(production, "PriorityLevelConfiguration", LEVEL)
    assert "namespace" not in level["metadata"]
    names = sorted(s["metadata"]["name"] for s in ours(production))
    assert names == [
        "ray-serve-health-agents",
        "ray-serve-health-aggregator",
        "ray-serve-health-leader-election",
    ]
    for schema in ours(production):
        assert "namespace" not in schema["metadata"]
        assert "$(" not in yaml.safe_dump(schema), "a var kustomize did not resolve"


@pytest.mark.parametrize("version", ["1.29.0", "1.30.0", "latest"])
def test_objects_are_valid_flowcontrol_v1(production: list[dict[str, Any]], version: str) -> None:
    version = kubernetes_validate.latest_version() if version == "latest" else version
    for obj in production:
        if obj["apiVersion"].startswith("flowcontrol.apiserver.k8s.io/"):
            kubernetes_validate.validate(obj, version, strict=True)


def test_flowcontrol_v1_does_not_exist_before_kubernetes_1_29(
    production: list[dict[str, Any]],
) -> None:
    """The component needs 1.29 (docs/install.md says so); the check above is not vacuous."""
    level = find(production, "PriorityLevelConfiguration", LEVEL)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(level, "1.28.0", strict=True)
    broken = {**level, "spec": {**level["spec"], "limited": {"nominalConcurencyShares": 10}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30.0", strict=True)


def test_the_level_is_limited_and_queues(production: list[dict[str, Any]]) -> None:
    spec = find(production, "PriorityLevelConfiguration", LEVEL)["spec"]
    assert spec["type"] == "Limited"
    limited = spec["limited"]
    assert 0 < limited["nominalConcurrencyShares"] <= 40  # no more than workload-high's
    assert 0 <= limited["lendablePercent"] <= 100
    assert limited["limitResponse"]["type"] == "Queue"  # a burst waits, not 429
    queuing = limited["limitResponse"]["queuing"]
    assert 0 < queuing["handSize"] <= queuing["queues"]
    assert queuing["queueLengthLimit"] > 0


# -- subjects -----------------------------------------------------------------------------


def subjects(schema: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (s["serviceAccount"]["namespace"], s["serviceAccount"]["name"])
        for rules in schema["spec"]["rules"]
        for s in rules["subjects"]
    ]


def accounts(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The rendered ServiceAccounts: name -> namespace."""
    return {
        o["metadata"]["name"]: o["metadata"]["namespace"]
        for o in objects
        if o["kind"] == "ServiceAccount"
    }


def check_subjects(objects: list[dict[str, Any]], namespace: str) -> None:
    rendered = accounts(objects)
    assert rendered == {AGGREGATOR_SA: namespace, AGENT_SA: namespace}
    aggregator_account = (rendered[AGGREGATOR_SA], AGGREGATOR_SA)
    agent_account = (rendered[AGENT_SA], AGENT_SA)
    by_name = {s["metadata"]["name"]: s for s in ours(objects)}
    assert subjects(by_name[LEASE_SCHEMA]) == [aggregator_account]
    assert subjects(by_name["ray-serve-health-aggregator"]) == [aggregator_account]
    assert subjects(by_name["ray-serve-health-agents"]) == [agent_account]
    lease_rule = by_name[LEASE_SCHEMA]["spec"]["rules"][0]["resourceRules"][0]
    assert lease_rule["namespaces"] == [namespace]


def test_subjects_are_the_rendered_service_accounts(production: list[dict[str, Any]]) -> None:
    check_subjects(production, NAMESPACE)


def write_overlay(tmp_path: Path, **fields: Any) -> Path:
    here = tmp_path / "mine"
    here.mkdir()
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(ROOT / PRODUCTION, here)],
        **fields,
    }
    (here / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return here


def test_a_user_overlay_in_another_namespace_moves_the_subjects_along(tmp_path: Path) -> None:
    objects = render_written(write_overlay(tmp_path, namespace="platform"))
    check_subjects(objects, "platform")


# -- precedence -----------------------------------------------------------------------------


def test_precedence_wins_over_service_accounts_but_not_over_the_control_plane(
    production: list[dict[str, Any]],
) -> None:
    for schema in ours(production):
        name, precedence = schema["metadata"]["name"], schema["spec"]["matchingPrecedence"]
        for builtin in ABOVE:
            assert precedence > BUILTIN_PRECEDENCE[builtin][0], (name, builtin)
        for builtin in BELOW:
            assert precedence < BUILTIN_PRECEDENCE[builtin][0], (name, builtin)
        ties = [b for b, (value, _) in BUILTIN_PRECEDENCE.items() if value == precedence]
        assert not ties, f"{name} ties with {ties}: the name would decide"
    values = [s["spec"]["matchingPrecedence"] for s in ours(production)]
    assert len(set(values)) == len(values)


def test_the_lease_schema_comes_before_the_aggregators_catch_all(
    production: list[dict[str, Any]],
) -> None:
    """Both match a Lease renewal of the aggregator: the Lease one must be tried first."""
    by_name = {s["metadata"]["name"]: s for s in ours(production)}
    lease = by_name[LEASE_SCHEMA]["spec"]
    assert (
        lease["matchingPrecedence"]
        < (by_name["ray-serve-health-aggregator"]["spec"]["matchingPrecedence"])
    )
    assert lease["priorityLevelConfiguration"]["name"] == "leader-election"
    (rules,) = lease["rules"]
    (rule,) = rules["resourceRules"]
    assert rule["apiGroups"] == ["coordination.k8s.io"]
    assert rule["resources"] == ["leases"]


def test_the_lease_schema_covers_every_lease_verb_the_aggregator_may_use(
    production: list[dict[str, Any]],
) -> None:
    """Its Role's verbs on leases (deploy/base/aggregator/rbac.yaml) are the schema's."""
    role = find(production, "Role", "ray-serve-health-aggregator")
    granted = {
        verb for rule in role["rules"] if "leases" in rule["resources"] for verb in rule["verbs"]
    }
    schema = find(production, "FlowSchema", LEASE_SCHEMA)
    assert granted == set(schema["spec"]["rules"][0]["resourceRules"][0]["verbs"])


# -- what the API server would do --------------------------------------------------------


def all_schemas(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*builtin_schemas(), *ours(objects)]


@pytest.mark.parametrize("verb", ["get", "create", "update"])
def test_the_aggregators_lease_requests_go_to_leader_election(
    production: list[dict[str, Any]], verb: str
) -> None:
    request = aggregator(verb, "coordination.k8s.io", "leases", NAMESPACE)
    assert classify(all_schemas(production), request) == (LEASE_SCHEMA, "leader-election")


@pytest.mark.parametrize(
    ("verb", "group", "resource", "where"),
    [
        ("patch", "", "pods/status", "ray"),
        ("patch", "", "pods", "ray"),
        ("list", "", "pods", ""),
        ("create", "", "events", "ray"),
        ("create", "authentication.k8s.io", "tokenreviews", ""),
        ("get", "coordination.k8s.io", "leases", "elsewhere"),  # another namespace's Lease
        ("delete", "coordination.k8s.io", "leases", NAMESPACE),  # a verb it does not use
    ],
)
def test_the_aggregators_other_requests_go_to_our_level(
    production: list[dict[str, Any]], verb: str, group: str, resource: str, where: str
) -> None:
    request = aggregator(verb, group, resource, where)
    assert classify(all_schemas(production), request) == ("ray-serve-health-aggregator", LEVEL)


@pytest.mark.parametrize(
    ("verb", "group", "resource", "where"),
    [
        ("get", "coordination.k8s.io", "leases", NAMESPACE),  # never leader-election
        ("patch", "", "pods/status", "ray"),
        ("create", "", "events", "ray"),
    ],
)
def test_the_daemonset_agents_go_to_our_level(
    production: list[dict[str, Any]], verb: str, group: str, resource: str, where: str
) -> None:
    request = Request(NAMESPACE, AGENT_SA, verb, group, resource, where)
    assert classify(all_schemas(production), request) == ("ray-serve-health-agents", LEVEL)


@pytest.mark.parametrize(
    ("namespace", "account"),
    [
        ("ray", "rayservice-sample"),  # a sidecar account, not added
        ("ray-serve-health", "default"),  # another account of our namespace
        ("other", AGGREGATOR_SA),  # our name, another namespace
    ],
)
def test_nobody_elses_requests_change_level(
    production: list[dict[str, Any]], namespace: str, account: str
) -> None:
    for verb, group, resource in (
        ("update", "coordination.k8s.io", "leases"),
        ("patch", "", "pods"),
    ):
        request = Request(namespace, account, verb, group, resource, namespace)
        assert classify(all_schemas(production), request) == ("service-accounts", "workload-low")


def documented_sidecar_patch() -> dict[str, Any]:
    """The `patches:` entry docs/install.md shows for a sidecar agent's account."""
    text = INSTALL_DOC.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
    found = [
        yaml.safe_load(block)
        for block in blocks
        if "ray-serve-health-agents" in block and "patches" in block
    ]
    assert len(found) == 1, "docs/install.md shows one patch adding a sidecar account"
    (entry,) = found[0]["patches"]
    return entry


def test_a_sidecar_account_added_as_docs_install_md_shows_goes_to_our_level(
    tmp_path: Path,
) -> None:
    patch = documented_sidecar_patch()
    objects = render_written(write_overlay(tmp_path, patches=[patch]))
    schema = find(objects, "FlowSchema", "ray-serve-health-agents")
    assert ("ray", "rayservice-sample") in subjects(schema)
    assert (NAMESPACE, AGENT_SA) in subjects(schema)  # the DaemonSet's stays
    kubernetes_validate.validate(schema, "1.30.0", strict=True)
    request = Request("ray", "rayservice-sample", "patch", "", "pods/status", "ray")
    assert classify(all_schemas(objects), request) == ("ray-serve-health-agents", LEVEL)


def test_the_component_says_what_it_needs() -> None:
    """Its kustomization and the production example name the Kubernetes version it needs."""
    assert "1.29" in (COMPONENT / "kustomization.yaml").read_text()
    assert "api-priority" in (ROOT / PRODUCTION / "kustomization.yaml").read_text()
