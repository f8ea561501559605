"""The agents' fallback writes in deploy/ (issue 18: no aggregator answers, each agent writes for
its own pods): each installation grants the DaemonSet agent exactly the writes its aggregator's
settings let agents make, no more, and the sidecar example grants its Ray pods' account the
sidecar's.

What agents may write is what the aggregator tells them (``WriteSettings``, made by
``aggregator.wiring.write_settings`` from the aggregator's flags): the settings ConfigMap each
installation renders is loaded as the aggregator loads it, and the grants follow from that:

- fallback off (label mode, ``--agent-fallback auto``): the reads of its pod watch only;
- fallback on: the reads, plus the write of each mode the aggregator writes (label: pods patch;
  condition: pods/status patch) and events create; cluster-wide, or per Ray namespace with
  deploy/overlays/namespaced;

and an installation that grants any of it also installs the agents' admission policy, which
keeps the writes to the agents' own pods (tests/deploy/test_agent_admission_policy.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from aggregator.flags import AggregatorFlags
from aggregator.wiring import write_settings
from servehealth_common.config import load
from tests.deploy.manifests import ROOT, environment, find, render
from tests.deploy.test_rbac import (
    AGENT,
    AGENT_READS,
    ALL,
    CALLS,
    NAMESPACED,
    Permission,
    grants,
    rules_of,
)

AGGREGATOR = "ray-serve-health-aggregator"
# The writes of each kind, as the agent makes them through the shared client (the calls the
# aggregator's writes make: one table, tests/deploy/test_rbac.py's).
LABEL_WRITE = CALLS["patch_pod"]
CONDITION_WRITE = CALLS["patch_pod_status"]
EVENTS = CALLS["create_event"]
# The agents' read of the aggregator's Lease while they have no stream (issue 26).
LEASE_READS = CALLS["get_lease"] | CALLS["watch_lease"]
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


def aggregator_flags(objects: list[dict[str, Any]]) -> AggregatorFlags:
    """The aggregator's settings as it loads them from the rendered Deployment."""
    deployment = find(objects, "Deployment", AGGREGATOR)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    environ = {
        k: v
        for k, v in environment(container, objects).items()
        if not k.startswith("SERVE_HEALTH_TLS_")
    }
    return load(AggregatorFlags, container.get("args", []), environ, "serve-health-aggregator", "")


def fallback_writes(objects: list[dict[str, Any]]) -> set[Permission]:
    """What the aggregator lets its agents write when none answers (empty: no fallback)."""
    writes = write_settings(aggregator_flags(objects))
    if not writes.fallback:
        return set()
    found = set(EVENTS)
    if writes.label:
        found |= LABEL_WRITE
    if writes.condition:
        found |= CONDITION_WRITE
    return found


@pytest.mark.parametrize("directory", INSTALLS)
def test_the_agents_may_write_exactly_what_their_aggregator_lets_them(directory: str) -> None:
    """... and, where they may write, read the aggregator's Lease in its namespace (issue 26:
    they fall back only while no aggregator renews it)."""
    objects = render(directory)
    by_scope = grants(objects, AGENT)
    expected = AGENT_READS | fallback_writes(objects)
    scopes = NAMESPACED.get(directory, (ALL,))
    wanted = {scope: expected for scope in scopes}
    if fallback_writes(objects):
        wanted[aggregator_namespace(objects)] = LEASE_READS
    assert by_scope == wanted


def aggregator_namespace(objects: list[dict[str, Any]]) -> str:
    return str(find(objects, "ServiceAccount", AGGREGATOR)["metadata"]["namespace"])


@pytest.mark.parametrize("directory", INSTALLS)
def test_the_agents_read_the_one_lease_their_aggregator_renews(directory: str) -> None:
    """The Lease rules name exactly the aggregator's --leader-elect-lease-name, and it runs
    with --leader-elect (else the settings name no Lease, and the grant is useless)."""
    objects = render(directory)
    if not fallback_writes(objects):
        return
    flags = aggregator_flags(objects)
    assert flags.leader_elect
    roles = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"].startswith(AGENT)]
    assert roles
    for role in roles:
        assert role["metadata"]["namespace"] == aggregator_namespace(objects)
        assert role["rules"] == [
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [flags.leader_elect_lease_name],
                "verbs": ["get", "watch"],
            }
        ]


def test_fallback_is_on_where_the_docs_say() -> None:
    """auto: on in condition mode, off in label mode; deploy/examples/label-mode-fallback turns
    it on in label mode."""
    on = {d for d in INSTALLS if fallback_writes(render(d))}
    assert on == {
        "deploy/overlays/readiness-gate-mode",
        "deploy/overlays/namespaced",
        "deploy/examples/production",
        "deploy/examples/label-mode-fallback",
        "deploy/examples/both-mode",
    }
    assert fallback_writes(render("deploy/examples/both-mode")) == {
        ("", "pods", "patch"),
        ("", "pods/status", "patch"),
        ("", "events", "create"),
    }
    assert fallback_writes(render("deploy/overlays/readiness-gate-mode")) == {
        ("", "pods/status", "patch"),
        ("", "events", "create"),
    }
    assert fallback_writes(render("deploy/examples/label-mode-fallback")) == {
        ("", "pods", "patch"),
        ("", "events", "create"),
    }


@pytest.mark.parametrize("directory", INSTALLS)
def test_a_grant_to_write_comes_with_the_policy_that_limits_it(directory: str) -> None:
    objects = render(directory)
    find(objects, "ValidatingAdmissionPolicy", AGENT)
    find(objects, "ValidatingAdmissionPolicyBinding", AGENT)


def test_in_the_namespaced_overlay_the_agents_write_in_the_ray_namespaces_only() -> None:
    objects = render("deploy/overlays/namespaced")
    writers = [
        o
        for o in objects
        if o["kind"] in {"RoleBinding", "ClusterRoleBinding"}
        and o["metadata"]["name"].startswith(f"{AGENT}-")
        and not o["metadata"]["name"].startswith(f"{AGENT}-lease-")  # the Lease's reads
    ]
    assert [(o["kind"], o["metadata"]["namespace"]) for o in writers] == [("RoleBinding", "ray")]


def test_the_sidecar_example_grants_its_pods_the_sidecars_fallback() -> None:
    """The Ray pods' own account may watch its pod while fallback lasts (list and watch, a
    get when the list is refused), write the condition and record Events, in its namespace (a
    Role): the label's pods patch is left for you to add in label mode (a comment says
    where)."""
    objects = render("deploy/examples/rayservice-sidecar")
    account = find(objects, "ServiceAccount")["metadata"]["name"]
    role = find(objects, "Role")
    binding = find(objects, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert rules_of(role) == CALLS["get_pod"] | AGENT_READS | CONDITION_WRITE | EVENTS
    assert not [o for o in objects if o["kind"] in {"ClusterRole", "ClusterRoleBinding"}]


def test_the_sidecar_example_grants_the_lease_in_the_aggregators_namespace() -> None:
    """lease-rbac.yaml (applied apart, in the aggregator's namespace): get and watch on the
    one Lease the aggregators renew, for the Ray pods' account in their namespace."""
    text = (ROOT / "deploy/examples/rayservice-sidecar/lease-rbac.yaml").read_text()
    role, binding = yaml.safe_load_all(text)
    account = find(render("deploy/examples/rayservice-sidecar"), "ServiceAccount")
    lease = AggregatorFlags().leader_elect_lease_name
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [lease],
            "verbs": ["get", "watch"],
        }
    ]
    assert rules_of(role) == LEASE_READS
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    [subject] = binding["subjects"]
    assert subject["name"] == account["metadata"]["name"]
    assert subject["namespace"]  # the Ray namespace: not the RoleBinding's own
