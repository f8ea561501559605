"""Issue 28, point 5: an agent that starts while no aggregator answers (a new node, a rebooted
one, a sidecar of a pod created during the outage) has never received an aggregator's settings,
so it knows only its own flags. Wherever deploy/ lets agents fall back, every rendered agent
presets what its aggregator would tell it: ``--fallback-write`` (the mode), the label key and the
condition type the aggregator writes, and the Lease it renews (``--fallback-lease``). Wherever
the aggregator allows no fallback (label mode by default, shadow mode), the agents preset no
write: the aggregator's settings would forbid it, and the agents have no grant.

Both sides are loaded as the programs load them (``servehealth_common.config.load`` of the
rendered environment, the settings ConfigMap included), and compared through the code the
agent runs: ``rules_from`` of the aggregator's ``WriteSettings`` against the agent's
``fallback_rules``."""

from __future__ import annotations

from typing import Any

import pytest

from aggregator.fallback_settings import write_settings
from aggregator.flags import AggregatorFlags
from node_agent.fallback.wire import rules_from
from node_agent.flags import AgentFlags
from servehealth_common.config import load
from tests.deploy.manifests import environment, find, pod_specs, render
from tests.deploy.test_agent_rbac import INSTALLS

AGGREGATOR = "ray-serve-health-aggregator"
AGENT = "ray-serve-health-agent"
# The sidecar examples run beside the aggregator of the readiness-gate overlay (their comments).
SIDECAR_EXAMPLES = {
    "deploy/examples/rayservice-sidecar": "deploy/overlays/readiness-gate-mode",
    "deploy/examples/rayservice-readiness-gate": "deploy/overlays/readiness-gate-mode",
}


def loaded(cls: Any, container: dict[str, Any], objects: list[dict[str, Any]], namespace: str):
    """(flags, environment) of a container as its program loads them, the downward API's
    namespace filled in (TLS files left out: they exist only in the pod)."""
    environ = {
        name: value.replace("downward-pod_namespace", namespace)
        for name, value in environment(container, objects).items()
        if not name.startswith("SERVE_HEALTH_TLS_")
    }
    environ["POD_NAMESPACE"] = namespace
    command = container["command"][0]
    return load(cls, container.get("args", []), environ, command, ""), environ


def aggregator_writes(objects: list[dict[str, Any]]) -> Any:
    """What the rendered aggregator tells its agents (``AgentSettings.writes``)."""
    deployment = find(objects, "Deployment", AGGREGATOR)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    flags, environ = loaded(
        AggregatorFlags, container, objects, deployment["metadata"]["namespace"]
    )
    return write_settings(flags, environ)


def check_agent(
    container: dict[str, Any], objects: list[dict[str, Any]], namespace: str, writes: Any
) -> None:
    flags, _ = loaded(AgentFlags, container, objects, namespace)
    expected = rules_from(writes)
    if expected is None:
        # No fallback from this aggregator: an agent that never reached it must not write
        # either (shadow mode's rule, docs/operations.md), and has no grant to.
        assert flags.fallback_write == "", flags.fallback_write
        return
    assert flags.fallback_write, (
        "the aggregator allows fallback but an agent that never reached it writes nothing "
        "(SERVE_HEALTH_FALLBACK_WRITE unset)"
    )
    assert flags.fallback_rules == expected, (flags.fallback_rules, expected)
    assert writes.lease, "the aggregator renews no Lease"
    assert flags.fallback_lease == writes.lease


@pytest.mark.parametrize("directory", INSTALLS)
def test_every_daemonset_agent_presets_what_its_aggregator_writes(directory: str) -> None:
    objects = render(directory)
    writes = aggregator_writes(objects)
    daemonset = find(objects, "DaemonSet", AGENT)
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    check_agent(container, objects, daemonset["metadata"]["namespace"], writes)


def test_fallback_is_preset_in_the_installs_that_allow_it() -> None:
    """Not vacuous: both modes that fall back (condition; label, turned on) are among them."""
    preset = {}
    for directory in INSTALLS:
        objects = render(directory)
        daemonset = find(objects, "DaemonSet", AGENT)
        (container,) = daemonset["spec"]["template"]["spec"]["containers"]
        flags, _ = loaded(AgentFlags, container, objects, daemonset["metadata"]["namespace"])
        preset[directory] = flags.fallback_write
    assert preset["deploy/overlays/readiness-gate-mode"] == "condition"
    assert preset["deploy/overlays/namespaced"] == "condition"
    assert preset["deploy/examples/production"] == "condition"
    assert preset["deploy/examples/label-mode-fallback"] == "label"
    assert preset["deploy/examples/both-mode"] == "both"
    assert preset["deploy/overlays/label-mode"] == ""
    assert preset["deploy/overlays/shadow-mode"] == ""


@pytest.mark.parametrize("example", sorted(SIDECAR_EXAMPLES))
def test_every_sidecar_presets_what_its_aggregator_writes(example: str) -> None:
    writes = aggregator_writes(render(SIDECAR_EXAMPLES[example]))
    objects = render(example)
    service = find(objects, "RayService")
    sidecars = [
        container
        for _, spec in pod_specs(service)
        for container in spec["containers"]
        if container.get("command", [""])[0] == "serve-health-agent"
    ]
    assert sidecars
    for container in sidecars:
        # The sidecars run in the Ray namespace; the Lease they name is the aggregator's.
        check_agent(container, objects, "ray", writes)
