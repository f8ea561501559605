"""The aggregator's Kubernetes backend against the API emulator over real HTTP: discovery
(list, watch, resume, 410 re-list), seeding and the startup grace, writes only on change,
label drift, condition mode, events, and backend selection."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
from typing import Any

import grpc
import pytest

from aggregator.flags import AggregatorFlags
from aggregator.kube.api import KubeApi
from aggregator.metrics import Metrics
from aggregator.server import Aggregator
from aggregator.wiring import make_registry
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState, Source
from tests.conftest import FakeClock, StartAggregator, eventually
from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator
from testsupport.messages import (
    batch,
    hello,
    open_node_stream,
    open_stream,
    read_until_error,
    report,
)

SERVING, NOT_READY = pb.SERVE_STATE_SERVING, pb.SERVE_STATE_NOT_READY


@pytest.fixture
def start_kube(start_kube: StartAggregator) -> StartAggregator:
    """The emulator's aggregator, allowing one DaemonSet stream to speak for 1000 pods (some
    tests do; the default allows 512)."""

    async def start(**overrides: Any) -> Aggregator:
        return await start_kube(**{"max_pods_per_stream": 1000, **overrides})

    return start


def label(kube: KubeEmulator, name: str, namespace: str = "default") -> str | None:
    return kube.pod_labels(namespace, name).get("ray.io/serve")


def state(aggregator: Aggregator, name: str, namespace: str = "default") -> ServeState | None:
    record = aggregator.core.pod(PodKey(namespace, name))
    return record.state if record else None


async def send(call: grpc.aio.StreamStreamCall, message: pb.AgentMessage) -> None:
    await call.write(message)
    assert (await call.read()).WhichOneof("kind") == "ack"


# -- discovery -------------------------------------------------------------------------


async def test_pods_appear_update_and_vanish(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    kube_emulator.add_pod("default", "listed", pod_ip="127.0.0.1")
    kube_emulator.add_pod("default", "not-ray", labels={"app": "web"})
    aggregator = await start_kube(startup_grace=60)  # no pulls: this test is about discovery
    assert state(aggregator, "listed") is ServeState.UNKNOWN
    assert state(aggregator, "not-ray") is None  # outside the pod selector
    await kube_emulator.wait_for_watches(1)

    kube_emulator.add_pod("default", "watched", pod_ip="127.0.0.2", serve_port=8123)
    await eventually(lambda: state(aggregator, "watched") is ServeState.UNKNOWN)
    info = aggregator.registry.pod(PodKey("default", "watched"))
    assert info is not None
    assert (info.pod_ip, info.serve_port, info.node_name) == ("127.0.0.2", 8123, "node-1")

    kube_emulator.modify_pod("default", "watched", pod_ip="127.0.0.9")
    await eventually(
        lambda: (
            (p := aggregator.registry.pod(PodKey("default", "watched"))) and p.pod_ip == "127.0.0.9"
        )
    )
    kube_emulator.add_pod("default", "no-serve-port", serve_port=None)
    await eventually(lambda: aggregator.registry.pod(PodKey("default", "no-serve-port")))
    assert aggregator.registry.pod(PodKey("default", "no-serve-port")).serve_port == 8000  # type: ignore[union-attr]

    kube_emulator.delete_pod("default", "watched")
    await eventually(lambda: state(aggregator, "watched") is None)
    kube_emulator.modify_pod("default", "listed", labels={"ray.io/node-type": None})
    await eventually(lambda: state(aggregator, "listed") is None)  # left the selector
    assert kube_emulator.requests("PATCH") == []


async def test_namespaces_limit_discovery(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    kube_emulator.add_pod("ray", "in-scope")
    kube_emulator.add_pod("other", "out-of-scope")
    aggregator = await start_kube(namespace=("ray",))
    assert state(aggregator, "in-scope", "ray") is ServeState.UNKNOWN
    assert state(aggregator, "out-of-scope", "other") is None


@pytest.mark.parametrize("abrupt", [pytest.param(False, id="ended"), pytest.param(True, id="cut")])
async def test_dropped_watch_resumes(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, abrupt: bool
) -> None:
    kube_emulator.add_pod("default", "before")  # so the list has a real resourceVersion
    aggregator = await start_kube()
    await kube_emulator.wait_for_watches(1)
    assert kube_emulator.drop_watches(abrupt=abrupt) == 1
    kube_emulator.add_pod("default", "after-drop")
    await eventually(lambda: state(aggregator, "after-drop") is ServeState.UNKNOWN, timeout=15)
    rewatch = kube_emulator.watch_requests()[-1]
    assert rewatch.params.get("resourceVersion") not in (None, "", "0")  # resumed, not re-listed
    assert len(kube_emulator.requests("GET", verb="list")) == 1


async def test_410_gone_relists_and_reconciles(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    kube_emulator.add_pod("default", "stays")
    kube_emulator.add_pod("default", "deleted-in-the-gap")
    aggregator = await start_kube()
    await kube_emulator.wait_for_watches(1)
    # Cut the watch and keep it down while the cluster changes and history is compacted.
    kube_emulator.fail_next(2, status=500, verb="watch")
    kube_emulator.drop_watches(abrupt=True)
    kube_emulator.delete_pod("default", "deleted-in-the-gap")
    kube_emulator.add_pod("default", "added-in-the-gap")
    kube_emulator.compact()
    await eventually(
        lambda: state(aggregator, "added-in-the-gap") is ServeState.UNKNOWN, timeout=20
    )
    assert state(aggregator, "deleted-in-the-gap") is None
    assert state(aggregator, "stays") is ServeState.UNKNOWN
    gone = aggregator.metrics.registry.get_sample_value(
        "serve_health_watch_restarts_total", {"reason": "gone"}
    )
    assert gone is not None
    assert gone >= 1
    assert len(kube_emulator.requests("GET", verb="list")) >= 2


# -- writes ----------------------------------------------------------------------------


async def test_1000_pods_then_60s_of_heartbeats_make_zero_patches(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    names = [f"ray-worker-{i}" for i in range(1000)]
    for name in names:
        kube_emulator.add_pod("default", name)
    clock = FakeClock()
    aggregator = await start_kube(  # expiry only where the test calls it (as below)
        clock=clock, kube_qps=1000, kube_burst=1000, expiry_interval=3600.0
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_node_stream(channel)
        sequence = 1
        await send(call, batch([("default", n, SERVING) for n in names], sequence))
        await eventually(lambda: aggregator.registry.writer.pending == 0, timeout=60)
        assert all(label(kube_emulator, n) == "true" for n in names)
        assert len(kube_emulator.requests("PATCH")) == 1000  # one write per pod, no more
        mark = kube_emulator.checkpoint()
        for _ in range(60):  # one minute of 1 Hz heartbeats, on the fake clock
            clock.advance(1.0)
            sequence += 1
            await send(call, batch([("default", n, SERVING) for n in names], sequence))
            aggregator.core.expire()
        await eventually(lambda: aggregator.registry.writer.pending == 0, timeout=10)
        assert kube_emulator.requests("PATCH", since=mark) == []
        assert aggregator.core.counts()[ServeState.SERVING] == 1000
        call.cancel()


async def test_restart_with_1000_labelled_pods_writes_nothing(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    names = [f"ray-worker-{i}" for i in range(1000)]
    for name in names:
        kube_emulator.add_pod(
            "default", name, labels={**DEFAULT_POD_LABELS, "ray.io/serve": "true"}
        )
    clock = FakeClock()
    # Expiry only where the test calls it: the aggregator's own loop, on a real-time period,
    # could run between a clock.advance and the batch that follows it, and see every pod
    # silent (it did once in CI: PANIC over 1,000 of 1,000, its held writes then waiting on a
    # look this fake clock never lets finish).
    aggregator = await start_kube(clock=clock, heartbeat_ttl=3.0, expiry_interval=3600.0)
    # Seeded from the labels: SERVING before any agent said a word.
    assert aggregator.core.counts()[ServeState.SERVING] == 1000
    assert aggregator.core.pod(PodKey("default", names[0])).source is Source.SEED  # type: ignore[union-attr]
    reconnecting, never_back = names[:990], names[990:]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_node_stream(channel)
        for second in range(5):  # agents reconnect within the grace period (2 x TTL = 6 s)
            clock.advance(1.0)
            await send(call, batch([("default", n, SERVING) for n in reconnecting], second + 1))
            aggregator.core.expire()
        await eventually(lambda: aggregator.registry.writer.pending == 0, timeout=60)
        assert kube_emulator.requests("PATCH") == []
        assert state(aggregator, never_back[0]) is ServeState.SERVING  # still in grace
        # The end of the grace counts as the last word of every pod: one TTL more ...
        clock.advance(2.0)
        await send(call, batch([("default", n, SERVING) for n in reconnecting], 99))
        aggregator.core.expire()
        assert state(aggregator, never_back[0]) is ServeState.SERVING
        # ... then pods whose agent never came back go SILENT and lose the label.
        clock.advance(3.0)
        await send(call, batch([("default", n, SERVING) for n in reconnecting], 100))
        aggregator.core.expire()
        await kube_emulator.wait_until(  # 30 s were once too few with two busy loops
            lambda: all(label(kube_emulator, n) == "false" for n in never_back), within=90
        )
        assert state(aggregator, never_back[0]) is ServeState.SILENT
        assert len(kube_emulator.requests("PATCH")) == len(never_back)
        assert all(label(kube_emulator, n) == "true" for n in reconnecting)
        call.cancel()


async def test_a_label_changed_by_someone_else_is_put_back(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a")
    aggregator = await start_kube()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, uid=pod["metadata"]["uid"])
        await send(call, report(pb.SERVE_STATE_DRAINING, 1, "This node is being drained."))
        # DRAINING wants "false"; a missing label already counts as false: nothing written.
        await eventually(lambda: aggregator.registry.writer.pending == 0, timeout=5)
        assert kube_emulator.requests("PATCH") == []
        kube_emulator.modify_pod("default", "pod-a", labels={"ray.io/serve": "true"})
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-a") == "false")
        patch = kube_emulator.requests("PATCH")[-1]
        assert patch.content_type == "application/merge-patch+json"
        assert patch.body == {"metadata": {"labels": {"ray.io/serve": "false"}}}
        call.cancel()


async def test_custom_label_key(kube_emulator: KubeEmulator, start_kube: StartAggregator) -> None:
    pod = kube_emulator.add_pod("default", "pod-a")
    aggregator = await start_kube(label_key="example.com/serve", events=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, uid=pod["metadata"]["uid"])
        await send(call, report(SERVING, 1, "success"))
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_labels("default", "pod-a").get("example.com/serve") == "true"
        )
        assert "ray.io/serve" not in kube_emulator.pod_labels("default", "pod-a")
        assert kube_emulator.events() == []  # --events false
        call.cancel()


async def test_events_on_label_changes(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a")
    aggregator = await start_kube()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, uid=pod["metadata"]["uid"])
        await send(call, report(SERVING, 1, "success"))
        await send(call, report(pb.SERVE_STATE_NO_PROXY, 2, "Connection refused"))
        await send(call, report(pb.SERVE_STATE_UNHEALTHY, 3, "timeout"))  # false -> false
        await eventually(lambda: len(kube_emulator.events("default")) == 2)
        by_reason = {event["reason"]: event for event in kube_emulator.events("default")}
        healthy, unhealthy = by_reason["ServeHealthy"], by_reason["ServeUnhealthy"]
        assert (healthy["type"], unhealthy["type"]) == ("Normal", "Warning")
        assert unhealthy["involvedObject"]["name"] == "pod-a"
        assert unhealthy["involvedObject"]["uid"] == pod["metadata"]["uid"]
        assert "SERVING -> NO_PROXY: Connection refused" in unhealthy["message"]
        call.cancel()


async def test_hello_for_an_unknown_pod_or_another_uid_is_refused(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    kube_emulator.add_pod("default", "pod-a")
    aggregator = await start_kube()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        for hello_name, uid, detail in [
            ("ghost", "", "not known to the kubernetes backend"),
            ("pod-a", "some-old-uid", "has uid"),
        ]:
            call = pb_grpc.ReportServiceStub(channel).Report()
            await call.write(hello("default", hello_name, uid))
            error = await read_until_error(call)
            assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert detail in (error.details() or "")


# -- condition mode --------------------------------------------------------------------

GATE = "ray.io/serve-proxy-healthy"


@pytest.mark.parametrize("mode", ["condition", "both"])
async def test_condition_mode_patches_pod_status(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, mode: str
) -> None:
    gated = kube_emulator.add_pod("default", "gated", readiness_gates=[GATE])
    plain = kube_emulator.add_pod("default", "plain")
    aggregator = await start_kube(mode=mode, events=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        gated_call = await open_stream(channel, "gated", uid=gated["metadata"]["uid"])
        plain_call = await open_stream(channel, "plain", uid=plain["metadata"]["uid"])
        await send(gated_call, report(SERVING, 1, "success"))
        await send(plain_call, report(SERVING, 1, "success"))
        await kube_emulator.wait_until(
            lambda: (
                kube_emulator.pod_conditions("default", "gated").get(GATE, {}).get("status")
                == "True"
            )
        )
        await send(gated_call, report(NOT_READY, 2, "No replicas are available yet."))
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_conditions("default", "gated")[GATE]["status"] == "False"
        )
        await eventually(lambda: aggregator.registry.writer.pending == 0, timeout=5)
        status_patches = kube_emulator.requests("PATCH", subresource="status")
        assert [p.name for p in status_patches] == ["gated", "gated"]  # never the ungated pod
        last = status_patches[-1]
        assert last.content_type == "application/strategic-merge-patch+json"
        (condition,) = last.body["status"]["conditions"]
        assert condition["type"] == GATE
        assert condition["status"] == "False"
        assert condition["reason"] == "ServeProxyNotServing"
        assert condition["message"] == "NOT_READY: No replicas are available yet."
        assert condition["lastTransitionTime"].endswith("Z")
        # Other conditions of the pod are untouched (merged by type).
        assert kube_emulator.pod_conditions("default", "gated")["Ready"]["status"] == "True"
        label_patches = kube_emulator.requests("PATCH", subresource=None)
        if mode == "condition":
            assert label_patches == []
        else:
            assert {p.name for p in label_patches} == {"gated", "plain"}
        gated_call.cancel()
        plain_call.cancel()


# -- backend selection -----------------------------------------------------------------


async def test_auto_backend_picks_kubernetes_with_a_kubeconfig(
    kube_emulator: KubeEmulator, start_aggregator: StartAggregator, kubeconfig_path: pathlib.Path
) -> None:
    aggregator = await start_aggregator(kube_backend="auto", kubeconfig=str(kubeconfig_path))
    assert aggregator.registry.name == "kubernetes"


def test_without_a_config_auto_is_memory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    registry = make_registry(AggregatorFlags(kube_backend="auto"), Metrics("test"))
    assert registry.name == "memory"


def test_kubernetes_backend_without_a_config_exits_with_a_clear_error(
    tmp_path: pathlib.Path,
) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    }
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    result = subprocess.run(
        [sys.executable, "-m", "aggregator", "--kube-backend", "kubernetes"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no Kubernetes configuration" in result.stderr


# -- stopping -----------------------------------------------------------------------------


async def test_drain_waits_for_writes_already_sent_and_starts_no_other(
    kube_emulator: KubeEmulator,
) -> None:
    kube_emulator.add_pod("default", "a")
    api = KubeApi(kube_emulator.client_configuration(), timeout=5, concurrency=1)
    kube_emulator.slow(0.3)
    sent = asyncio.create_task(
        api.patch_pod(PodKey("default", "a"), {"metadata": {"labels": {"serve": "true"}}})
    )
    queued = asyncio.create_task(
        api.patch_pod(PodKey("default", "a"), {"metadata": {"labels": {"serve": "false"}}})
    )
    await kube_emulator.wait_until(lambda: kube_emulator.requests("PATCH"))  # the first is out
    try:
        assert await api.drain(within=5)
        # The one already sent landed; the one still queued was never sent.
        assert kube_emulator.pod_labels("default", "a")["serve"] == "true"
        assert len(kube_emulator.requests("PATCH")) == 1
        assert (await sent)["metadata"]["labels"]["serve"] == "true"
        with pytest.raises(asyncio.CancelledError):
            await queued
    finally:
        api.close()


async def test_a_daemonset_report_for_an_untracked_pod_is_counted_and_nothing_else(
    kube_emulator: KubeEmulator, start_kube: StartAggregator
) -> None:
    """Issue 12, point 5: a DaemonSet agent may see a pod the aggregator does not track (not
    listed yet, or outside its selector): that report is skipped and counted in
    ``serve_health_reports_ignored_total{reason="unknown_pod"}``; the stream, the other pods
    and the API see nothing else."""
    kube_emulator.add_pod("default", "tracked")
    aggregator = await start_kube()
    ignored = aggregator.metrics.reports_ignored.labels("unknown_pod")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_node_stream(channel)
        mark = kube_emulator.checkpoint()
        reports = [("default", "stranger", SERVING), ("default", "tracked", SERVING)]
        await send(call, batch(reports, 1))
        assert ignored._value.get() == 1
        assert state(aggregator, "stranger") is None  # not tracked, not created
        assert state(aggregator, "tracked") is ServeState.SERVING  # the stream goes on
        await send(call, batch([("default", "stranger", SERVING)], 2))
        assert ignored._value.get() == 2
        assert aggregator.core.tracked() == 1
        await kube_emulator.wait_until(lambda: label(kube_emulator, "tracked") == "true")
        patched = {request.name for request in kube_emulator.requests("PATCH", since=mark)}
        assert patched == {"tracked"}  # nothing was written for the stranger
        call.cancel()
