"""Agent authentication in deploy/: every agent container (the DaemonSet and the sidecars of the
examples) reads a projected ServiceAccount token of the audience the aggregator checks, at the
path the agent reads by default, and the aggregator checks tokens with TokenReview and lets
exactly the DaemonSet's ServiceAccount (in its own namespace) report as a node agent."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest

from aggregator.flags import AggregatorFlags
from node_agent.token import DEFAULT_TOKEN_FILE
from servehealth_common.config import load
from tests.deploy.manifests import env_of, find, pod_specs, render

AGENT_DIRECTORIES = [
    "deploy/base/agent-daemonset",
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/examples/rayservice-sidecar",
    "deploy/examples/rayservice-readiness-gate",
]
AGGREGATOR_DIRECTORIES = [
    "deploy/base/aggregator",
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
]


def agents(directory: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    found = []
    for obj in render(directory):
        for where, spec in pod_specs(obj):
            for container in spec["containers"]:
                if container.get("command") == ["serve-health-agent"]:
                    found.append((f"{obj['kind']} {where}", spec, container))
    assert found, directory
    return found


@pytest.mark.parametrize("directory", AGENT_DIRECTORIES)
def test_every_agent_reads_a_projected_token_for_the_aggregator(directory: str) -> None:
    path = PurePosixPath(DEFAULT_TOKEN_FILE)
    for where, spec, container in agents(directory):
        assert "SERVE_HEALTH_TOKEN_FILE" not in env_of(container), where  # the default path
        [mount] = [
            m for m in container.get("volumeMounts", []) if m["mountPath"] == str(path.parent)
        ]
        assert mount.get("readOnly") is True, where
        [volume] = [v for v in spec.get("volumes", []) if v["name"] == mount["name"]]
        [source] = volume["projected"]["sources"]
        assert source["serviceAccountToken"] == {
            "audience": AggregatorFlags.auth_audience,
            "expirationSeconds": 3600,
            "path": path.name,
        }, where


@pytest.mark.parametrize("directory", AGGREGATOR_DIRECTORIES)
def test_the_aggregator_checks_tokens_and_allows_the_daemonset_account(directory: str) -> None:
    objects = render(directory)
    deployment = find(objects, "Deployment", "ray-serve-health-aggregator")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    namespace = deployment["metadata"].get("namespace", "default")
    environ = {
        name: str(entry["value"]).replace("$(POD_NAMESPACE)", namespace)
        for name, entry in env.items()
        if "value" in entry
    }
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    settings = load(AggregatorFlags, [], environ, "serve-health-aggregator", "")
    assert settings.auth == "tokenreview"
    assert settings.auth_audience == "ray-serve-health"
    agent_accounts = [
        f"{o['metadata'].get('namespace', 'default')}/{o['metadata']['name']}"
        for o in objects
        if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "ray-serve-health-agent"
    ]
    expected = (f"{namespace}/ray-serve-health-agent",)
    assert settings.auth_node_agent_service_account == expected
    if agent_accounts:  # the overlays install the DaemonSet's ServiceAccount beside it
        assert tuple(agent_accounts) == expected
