"""Issue 28, point 7: the aggregator's pod needs no writable directory, so deploy/ gives it none
(an emptyDir would make ``kubectl drain`` refuse without ``--delete-emptydir-data`` and keep the
Cluster Autoscaler from removing its node: tests/deploy/test_drains.py). Its root filesystem is
read-only and the image's HOME and working directory are /tmp.

A real ``serve-health-aggregator`` on the emulator (Kubernetes backend, leader election: the
Lease, the leader label, pod list and watch, pull probes, a label write, an Event), with HOME and
TMPDIR pointing at an empty directory, from its start until it has stopped on SIGTERM (releasing
its Lease): the directory is still empty. (Its working directory here is the checkout, which
others write in, so it is not compared; in the image it is /tmp, HOME.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import eventually
from testsupport.kube.agent_processes import (
    LABEL,
    ProxyPool,
    add_pod,
    leading_aggregator,
    lease_holder,
)
from testsupport.kube.emulator import KubeEmulator

WAIT = 90.0


async def test_the_aggregator_writes_no_file(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kube = kube_emulator
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(home))
    pool = ProxyPool()
    (proxy,) = await pool.start(1)
    add_pod(kube, "worker-0", proxy, node_name="node-1")
    logs = tmp_path / "logs"
    aggregator = await asyncio.to_thread(
        leading_aggregator, logs, kubeconfig_path, lease_seconds=3, renew_deadline=2.0
    )
    try:
        # It leads, and writes: no agent speaks for the pod, so it pulls it and labels it.
        await eventually(lambda: lease_holder(kube) != "", WAIT)
        await eventually(lambda: kube.pod_labels("default", "worker-0").get(LABEL) == "true", WAIT)
        assert await asyncio.to_thread(aggregator.stop) == 0, aggregator.tail()
        assert lease_holder(kube) == ""  # released on SIGTERM: it ran to its end
    finally:
        await asyncio.to_thread(aggregator.stop)
        await pool.stop()
    assert list(home.rglob("*")) == [], "the aggregator wrote in HOME or TMPDIR"
