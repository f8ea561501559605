"""Issue 28, point 7: draining a node that runs an aggregator replica. ``kubectl drain`` refuses
to evict a pod with an ``emptyDir`` volume unless told ``--delete-emptydir-data``, and the
Cluster Autoscaler does not remove a node whose pods have local storage (unless they are
annotated ``cluster-autoscaler.kubernetes.io/safe-to-evict: "true"``). The aggregator writes no
file (tests/kube/test_aggregator_writes_no_files.py runs it with HOME and TMPDIR in an empty
directory), so it has no such volume: a drain and a scale-down take its replicas like any
stateless pod, within its PodDisruptionBudget.

DaemonSet pods are left out of both (``kubectl drain --ignore-daemonsets``; the autoscaler
ignores them), so the agents' in-memory ``/tmp`` does not block a drain."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import find, render, renderable

AGGREGATOR = "ray-serve-health-aggregator"
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
#: Volumes whose data lives on the node: what kubectl drain and the autoscaler refuse to lose.
LOCAL = {"emptyDir", "hostPath", "ephemeral"}


def installs() -> list[str]:
    return [
        str(directory)
        for directory in renderable()
        if any(
            o["kind"] == "Deployment" and o["metadata"]["name"] == AGGREGATOR
            for o in render(directory)
        )
    ]


@pytest.mark.parametrize("directory", installs())
def test_the_aggregator_has_no_local_storage_that_blocks_a_drain(directory: str) -> None:
    template = find(render(directory), "Deployment", AGGREGATOR)["spec"]["template"]
    spec = template["spec"]
    local = [v["name"] for v in spec.get("volumes", []) if LOCAL & v.keys()]
    annotations = template["metadata"].get("annotations", {})
    assert not local or annotations.get(SAFE_TO_EVICT) == "true", (
        f"{local}: kubectl drain refuses without --delete-emptydir-data, and the Cluster "
        "Autoscaler keeps the node"
    )
    # Dropped, not annotated: nothing in the aggregator writes a file.
    assert not local
    for container in spec["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounted = {m["name"] for m in container.get("volumeMounts", [])}
        assert mounted <= {v["name"] for v in spec.get("volumes", [])}
