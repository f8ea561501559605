"""Pods with no Serve proxy by design (issue 15), on the API emulator over real HTTP, with a fake
Ray dashboard: a real HTTP server on loopback that answers ``/api/serve/applications/`` with a
body captured from Ray 2.60 (Serve with ``proxy_location: HeadOnly``).

A worker that refuses probes in such a cluster is NO_PROXY_BY_DESIGN: label ``false``, not
counted toward PANIC, one Event (``ServeNoProxyByDesign``) and no more, visible in GetPod; in
condition mode its condition is True (reason ``NoProxyByDesign``). A dashboard that fails keeps
the state.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually
from testsupport.captures import SERVE_APPLICATIONS_HEADONLY
from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator
from testsupport.messages import open_stream, report

HEADONLY = SERVE_APPLICATIONS_HEADONLY.read_bytes()
TOKEN = "s3cret-token"
GATE = "ray.io/serve-proxy-healthy"
NO_PROXY = pb.SERVE_STATE_NO_PROXY


class FakeDashboard:
    """``GET /api/serve/applications/``: ``body`` with ``status``; 401 without the token."""

    def __init__(self) -> None:
        self.body = HEADONLY
        self.status = 200
        self.requests: list[str | None] = []  # the authorization header of each
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        authorization = request.headers.get("Authorization")
        self.requests.append(authorization)
        if authorization != f"Bearer {TOKEN}":
            return web.Response(status=401, text="Unauthorized: Missing authentication token")
        return web.Response(status=self.status, body=self.body, content_type="application/json")


@pytest.fixture
async def dashboard() -> AsyncIterator[FakeDashboard]:
    fake = FakeDashboard()
    app = web.Application()
    app.router.add_get("/api/serve/applications/", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield fake
    finally:
        await runner.cleanup()


async def start(start_kube: StartAggregator, token_file: Path, **overrides: Any) -> Aggregator:
    token_file.write_text(TOKEN + "\n")  # noqa: ASYNC240 - a few bytes in tmp_path
    return await start_kube(
        ray_dashboard_port=1,  # the head's named port wins
        ray_dashboard_token_file=str(token_file),
        startup_grace=60,  # no pulls: the reports here are the agent's
        **overrides,
    )


def state(aggregator: Aggregator, name: str = "raycluster-worker") -> ServeState | None:
    record = aggregator.core.pod(PodKey("default", name))
    return record.state if record else None


async def inspect(aggregator: Aggregator) -> tuple[pb.Pod, pb.Summary]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        stub = pb_grpc.InspectionServiceStub(channel)
        pod = await stub.GetPod(pb.GetPodRequest(namespace="default", name="raycluster-worker"))
        summary = await stub.GetSummary(pb.GetSummaryRequest())
    return pod, summary


def polls(aggregator: Aggregator, result: str) -> float:
    value = aggregator.metrics.registry.get_sample_value(
        "serve_health_serve_view_polls_total", {"result": result}
    )
    return value or 0.0


async def test_a_headonly_worker_is_no_proxy_by_design(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    dashboard: FakeDashboard,
    tmp_path: Path,
) -> None:
    # The worker served before (say, under EveryNode): it carries true, so leaving service is
    # one label write and one Event.
    worker = kube_emulator.add_ray_cluster(
        dashboard.port, labels={**DEFAULT_POD_LABELS, "ray.io/serve": "true"}
    )
    aggregator = await start(start_kube, tmp_path / "token", serve_view_interval=0.05)
    assert dashboard.requests[:1] == [f"Bearer {TOKEN}"]  # polled once before reports
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, "raycluster-worker", uid=worker["metadata"]["uid"])
        for sequence in range(1, 6):  # the agent's refusals, and later its resyncs
            await call.write(report(NO_PROXY, sequence, "Connection refused"))
            await call.read()
        await eventually(lambda: state(aggregator) is ServeState.NO_PROXY_BY_DESIGN)
        await kube_emulator.wait_until(
            lambda: (
                kube_emulator.pod_labels("default", "raycluster-worker")["ray.io/serve"] == "false"
            )
        )
        await kube_emulator.wait_until(lambda: len(kube_emulator.events("default")) == 1)
        (event,) = kube_emulator.events("default")
        assert (event["reason"], event["type"]) == ("ServeNoProxyByDesign", "Normal")
        assert "SERVING -> NO_PROXY_BY_DESIGN: proxy_location HeadOnly" in event["message"]

        pod, summary = await inspect(aggregator)
        assert pod.state == pb.SERVE_STATE_NO_PROXY_BY_DESIGN
        assert pod.reason.startswith("proxy_location HeadOnly: Serve runs no proxy on worker")
        assert "Connection refused" in pod.reason
        assert pod.desired_label == "false"
        assert summary.pods_by_state["SERVE_STATE_NO_PROXY_BY_DESIGN"] == 1
        assert (summary.panic, summary.panic_held_writes) == (False, 0)

        # The dashboard fails (500, then without the token): the state is kept, the failure
        # counted; more refusals change nothing, and no Event follows.
        dashboard.status = 500
        errors = polls(aggregator, "error")
        await eventually(lambda: polls(aggregator, "error") >= errors + 2)
        (tmp_path / "token").write_text("wrong")
        await eventually(lambda: polls(aggregator, "error") >= errors + 4)
        for sequence in range(6, 9):
            await call.write(report(NO_PROXY, sequence, "Connection refused"))
            await call.read()
        assert state(aggregator) is ServeState.NO_PROXY_BY_DESIGN
        assert len(kube_emulator.events("default")) == 1
        assert aggregator.metrics.registry.get_sample_value("serve_health_panic") == 0
        labels = [p for p in kube_emulator.requests("PATCH") if p.name == "raycluster-worker"]
        assert len(labels) == 1
        call.cancel()


async def test_a_proxy_meant_there_stays_no_proxy(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    dashboard: FakeDashboard,
    tmp_path: Path,
) -> None:
    # EveryNode, and the controller keeps a proxy on the worker's node: a refusal is a failure.
    document = json.loads(HEADONLY)
    proxy = copy.deepcopy(next(iter(document["proxies"].values())))
    proxy.update(node_id="worker-node", node_ip="127.0.0.2")
    document["proxies"]["worker-node"] = proxy
    document["proxy_location"] = "EveryNode"
    dashboard.body = json.dumps(document).encode()
    worker = kube_emulator.add_ray_cluster(dashboard.port)
    aggregator = await start(start_kube, tmp_path / "token", serve_view_interval=0.05)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, "raycluster-worker", uid=worker["metadata"]["uid"])
        await call.write(report(NO_PROXY, 1, "Connection refused"))
        await call.read()
        assert state(aggregator) is ServeState.NO_PROXY
        # Serve removes that proxy (its replicas left): judged again without a new report.
        document["proxies"].pop("worker-node")
        dashboard.body = json.dumps(document).encode()
        await eventually(lambda: state(aggregator) is ServeState.NO_PROXY_BY_DESIGN)
        record = aggregator.core.pod(PodKey("default", "raycluster-worker"))
        assert record is not None
        assert record.reason.startswith("Serve runs no proxy on node 127.0.0.2 (no replica")
        call.cancel()


async def test_condition_mode_makes_it_ready_with_reason_no_proxy_by_design(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    dashboard: FakeDashboard,
    tmp_path: Path,
) -> None:
    worker = kube_emulator.add_ray_cluster(dashboard.port, readiness_gates=[GATE])
    aggregator = await start(start_kube, tmp_path / "token", mode="both")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, "raycluster-worker", uid=worker["metadata"]["uid"])
        await call.write(report(NO_PROXY, 1, "Connection refused"))
        await call.read()
        await kube_emulator.wait_until(
            lambda: kube_emulator.pod_conditions("default", "raycluster-worker").get(GATE)
        )
        condition = kube_emulator.pod_conditions("default", "raycluster-worker")[GATE]
        assert (condition["status"], condition["reason"]) == ("True", "NoProxyByDesign")
        assert condition["message"].startswith("NO_PROXY_BY_DESIGN: proxy_location HeadOnly")
        assert "ray.io/serve" not in kube_emulator.pod_labels("default", "raycluster-worker")
        await kube_emulator.wait_until(lambda: len(kube_emulator.events("default")) == 1)
        assert kube_emulator.events("default")[0]["reason"] == "ServeNoProxyByDesign"
        call.cancel()
    await aggregator.stop()

    # A restarted aggregator takes the condition for what it says: nothing is written, no
    # Event, even before (or without) an answer from the dashboard.
    dashboard.status = 500
    patches = len(kube_emulator.requests("PATCH"))
    again = await start(start_kube, tmp_path / "token", mode="both")
    assert state(again) is ServeState.NO_PROXY_BY_DESIGN
    async with grpc.aio.insecure_channel(f"127.0.0.1:{again.port}") as channel:
        call = await open_stream(channel, "raycluster-worker", uid=worker["metadata"]["uid"])
        await call.write(report(NO_PROXY, 1, "Connection refused"))
        await call.read()
        assert state(again) is ServeState.NO_PROXY_BY_DESIGN
        call.cancel()
    await eventually(lambda: again.registry.writer.pending == 0)  # type: ignore[attr-defined]
    assert len(kube_emulator.requests("PATCH")) == patches
    assert len(kube_emulator.events("default")) == 1


@pytest.mark.parametrize("mode", ["condition", "both"])
async def test_condition_mode_warns_that_kuberays_label_still_routes_to_it(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    dashboard: FakeDashboard,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """Issue 27: in --mode condition a HeadOnly worker turns Ready (condition True), and the
    ``ray.io/serve: "true"`` KubeRay put on it at creation keeps it in the serve Service's
    selector: one WARNING per Ray cluster says so and what to run instead. --mode both writes
    the label ``false`` too: no warning."""
    labels = {**DEFAULT_POD_LABELS, "ray.io/serve": "true"}
    worker = kube_emulator.add_ray_cluster(dashboard.port, labels=labels, readiness_gates=[GATE])
    aggregator = await start(start_kube, tmp_path / "token", mode=mode)
    with caplog.at_level(logging.WARNING, logger="aggregator.kube.kubelet_probe"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
            call = await open_stream(channel, "raycluster-worker", uid=worker["metadata"]["uid"])
            for sequence in (1, 2, 3):
                await call.write(report(NO_PROXY, sequence, "Connection refused"))
                await call.read()
            await kube_emulator.wait_until(
                lambda: kube_emulator.pod_conditions("default", "raycluster-worker").get(GATE)
            )
            await eventually(lambda: aggregator.registry.writer.pending == 0)  # type: ignore[attr-defined]
            call.cancel()
    await aggregator.stop()
    warned = [r.getMessage() for r in caplog.records if "no Serve proxy by design" in r.message]
    if mode == "both":
        assert warned == []
        assert kube_emulator.pod_labels("default", "raycluster-worker")["ray.io/serve"] == "false"
        return
    assert len(warned) == 1, warned
    assert "ray.io/serve=true" in warned[0]
    assert "--mode both" in warned[0]
    assert "docs/install.md#headonly-workers" in warned[0]
