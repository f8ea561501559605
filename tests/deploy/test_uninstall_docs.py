"""docs/install.md's "Uninstalling" stops the agents before the cleanup (issue 28, point 4): its
numbered steps disarm the sidecars (the aggregator's agent fallback off, applied while it still
runs) and delete the agents' DaemonSet before they scale the aggregator to 0, and only then run
the cleanup Job; the commands name what the overlays render (the DaemonSet, its pods' labels,
the aggregator reading the setting from its settings ConfigMap), the setting does turn the
agents' fallback off, and the cleanup's own refusal gives the same commands.

tests/kube/test_uninstall_processes.py runs the same steps with the real programs."""

from __future__ import annotations

import os
import re
from unittest import mock

from aggregator.cleanup.agents import refusal
from aggregator.cli import parse
from aggregator.fallback_settings import write_settings
from aggregator.flags import AggregatorFlags
from tests.deploy.manifests import ROOT, environment, find, render

SECTION = (ROOT / "docs" / "install.md").read_text().split("## Uninstalling", 1)[1]
OVERLAY = "deploy/overlays/readiness-gate-mode"
NAMESPACE = "ray-serve-health"
DISARM_SIDECARS = "SERVE_HEALTH_AGENT_FALLBACK=off"
DELETE_DAEMONSET = f"kubectl -n {NAMESPACE} delete daemonset/ray-serve-health-agent"
STOP_AGGREGATOR = "scale deployment/ray-serve-health-aggregator --replicas=0"
CLEANUP = "create job ray-serve-health-cleanup --from=cronjob/ray-serve-health-cleanup"


def steps() -> list[str]:
    """The section's numbered steps (top level: ``N. `` at the start of a line), in order."""
    parts = re.split(r"^\d+\. ", SECTION, flags=re.MULTILINE)
    return parts[1:]


def step_of(text: str) -> int:
    """The number of the first step that says ``text`` (AssertionError if none)."""
    found = [number for number, step in enumerate(steps(), 1) if text in step]
    assert found, f"no step of docs/install.md's Uninstalling says {text!r}"
    return found[0]


def test_the_agents_are_disarmed_before_the_aggregator_stops_and_the_cleanup_runs() -> None:
    assert len(steps()) == 5, [step.splitlines()[0] for step in steps()]
    assert step_of(DISARM_SIDECARS) < step_of(STOP_AGGREGATOR) < step_of(CLEANUP)
    assert step_of(DELETE_DAEMONSET) < step_of(STOP_AGGREGATOR)
    # The apply that turns the fallback off would create the DaemonSet again: delete it after.
    disarm = steps()[step_of(DISARM_SIDECARS) - 1]
    assert disarm.index("kubectl apply -k") < disarm.index(DELETE_DAEMONSET)
    assert "rollout status deployment/ray-serve-health-aggregator" in disarm


def test_the_commands_name_what_the_overlay_renders() -> None:
    objects = render(OVERLAY)
    daemonset = find(objects, "DaemonSet", "ray-serve-health-agent")
    assert daemonset["metadata"]["namespace"] == NAMESPACE
    wait = re.search(r"kubectl -n (\S+) wait --for=delete pod -l (\S+)=(\S+) ", SECTION)
    assert wait, "no wait for the agents' pods to be gone"
    assert wait[1] == NAMESPACE
    assert daemonset["spec"]["template"]["metadata"]["labels"][wait[2]] == wait[3]
    # The aggregator reads SERVE_HEALTH_AGENT_FALLBACK from the settings ConfigMap (envFrom),
    # where the docs' configMapGenerator merges it.
    deployment = find(objects, "Deployment", "ray-serve-health-aggregator")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert any("configMapRef" in source for source in container.get("envFrom", []))
    assert "- name: ray-serve-health-aggregator-settings\n" in SECTION
    assert f"- {DISARM_SIDECARS}\n" in SECTION


def test_the_setting_turns_the_agents_fallback_off() -> None:
    """With the readiness-gate overlay's settings (fallback on, by default, in condition mode)
    and the docs' setting merged, the aggregator tells its agents they may not write."""
    objects = render(OVERLAY)
    deployment = find(objects, "Deployment", "ray-serve-health-aggregator")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in environment(container, objects).items() if k.startswith("SERVE_")}
    env.pop("SERVE_HEALTH_LISTEN", None)
    before = write_settings(load_flags(env))
    assert before.condition
    assert before.fallback
    name, _, value = DISARM_SIDECARS.partition("=")
    assert not write_settings(load_flags({**env, name: value})).fallback


def load_flags(env: dict[str, str]) -> AggregatorFlags:
    """The aggregator's flags from this environment alone."""
    with mock.patch.dict(os.environ, env, clear=True):
        return parse([])


def test_the_cleanups_refusal_says_the_same() -> None:
    message = refusal([], "then", NAMESPACE)
    assert DELETE_DAEMONSET in message
    assert DISARM_SIDECARS in message
    assert '"Uninstalling"' in message
