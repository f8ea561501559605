"""The pull fallback and self-protection end to end on the Kubernetes backend: a killed agent
(SIGKILL of a real agent process), an agent that goes silent with its stream open, and PANIC
when most of the fleet fails at once (agents gone, proxies hung), seen through grpcurl."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from aggregator.server import Aggregator
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState, Source
from tests import grpcurl
from tests.conftest import StartAggregator, eventually
from testsupport import harness
from testsupport.fakes import (
    DRAINING,
    GRPC_DRAINING,
    NOT_POPULATED,
    FakeGrpcServeProxy,
    FakeServeProxy,
)
from testsupport.kube.emulator import DEFAULT_POD_LABELS, KubeEmulator
from testsupport.messages import open_stream, report

TTL, PULL_TIMEOUT = 3.0, 0.5
#: How long a test waits for the aggregator: only a hang takes this long (how long it does
#: take is a figure for bench/, not a bound here).
WAIT = 30.0


@pytest.fixture
def start_kube(start_kube: StartAggregator) -> StartAggregator:
    """The emulator's aggregator with a short startup grace and no events."""

    async def start(**overrides: Any) -> Aggregator:
        defaults = {
            "startup_grace": 0.3,
            "heartbeat_ttl": TTL,
            "pull_timeout": PULL_TIMEOUT,
            "events": False,
        }
        return await start_kube(**{**defaults, **overrides})

    return start


@pytest.fixture
async def proxies() -> AsyncIterator[list[FakeServeProxy]]:
    """Ten healthy fake Serve proxies on loopback ports."""
    started = [await FakeServeProxy().start() for _ in range(10)]
    yield started
    for proxy in started:
        await proxy.stop()


def add_pods(kube: KubeEmulator, proxies: list[FakeServeProxy]) -> list[dict[str, Any]]:
    return [
        kube.add_pod("default", f"pod-{i}", pod_ip="127.0.0.1", serve_port=proxy.port)
        for i, proxy in enumerate(proxies)
    ]


def label(kube: KubeEmulator, name: str) -> str | None:
    return kube.pod_labels("default", name).get("ray.io/serve")


def removals(kube: KubeEmulator, since: int = 0) -> list[str]:
    """Pods whose label was patched to false."""
    return [
        call.name
        for call in kube.requests("PATCH", since=since)
        if call.body.get("metadata", {}).get("labels", {}).get("ray.io/serve") == "false"
    ]


def record(aggregator: Aggregator, name: str) -> Any:
    return aggregator.core.pod(PodKey("default", name))


async def test_killed_agent_keeps_label_then_dead_proxy_loses_it(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    fake_proxy: FakeServeProxy,
    tmp_path: pathlib.Path,
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a", pod_ip="127.0.0.1", serve_port=fake_proxy.port)
    aggregator = await start_kube()
    identity = harness.PodIdentity("default", "pod-a", pod["metadata"]["uid"], "node-1")
    agent = await asyncio.to_thread(
        harness.start_agent, tmp_path, f"127.0.0.1:{aggregator.port}", fake_proxy.port, identity
    )
    try:
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-a") == "true", within=WAIT)
        mark = kube_emulator.checkpoint()
        os.kill(agent.pid, signal.SIGKILL)
        await asyncio.to_thread(agent.popen.wait, 10)
        # Pulled at once, and again before each TTL would run out: at least three pulls span
        # more than one TTL, all confirming SERVING; the label is never touched.
        await eventually(
            lambda: (r := record(aggregator, "pod-a")).source is Source.PULL and r.agent is None,
            WAIT,
        )
        pulls = aggregator.metrics.pull_probes.labels("SERVING")
        await eventually(lambda: pulls._value.get() >= 3, timeout=WAIT)
        assert record(aggregator, "pod-a").state is ServeState.SERVING
        assert kube_emulator.requests("PATCH", since=mark) == []

        loop = asyncio.get_running_loop()
        stopped = loop.time()
        await fake_proxy.stop()  # the proxy dies too: connections are refused
        await kube_emulator.wait_until(
            lambda: label(kube_emulator, "pod-a") == "false", within=WAIT
        )
        took = loop.time() - stopped
        print(f"label false {took:.2f}s after the proxy stopped")
        # Out by a pull that found nothing listening (not by silence), in one write.
        pulled = record(aggregator, "pod-a")
        assert (pulled.state, pulled.source) == (ServeState.NO_PROXY, Source.PULL)
        assert removals(kube_emulator, since=mark) == ["pod-a"]
    finally:
        agent.stop()


async def test_silent_agent_with_open_stream_is_pulled(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, fake_proxy: FakeServeProxy
) -> None:
    pod = kube_emulator.add_pod("default", "pod-a", pod_ip="127.0.0.1", serve_port=fake_proxy.port)
    aggregator = await start_kube(heartbeat_ttl=1.0, heartbeat_interval=0.3, pull_interval=60)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        call = await open_stream(channel, uid=pod["metadata"]["uid"])
        await call.write(report(pb.SERVE_STATE_SERVING, 1, "success"))
        await call.read()
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-a") == "true", within=WAIT)
        # The agent says nothing more but keeps its stream open: after the TTL its pod is
        # pulled (the puller may come first, or the expiry pass may make it SILENT first: both
        # race by design); the proxy answers, so the pod is SERVING and its label never moved.
        await eventually(
            lambda: (
                (r := record(aggregator, "pod-a")).state is ServeState.SERVING
                and r.source is Source.PULL
            ),
            timeout=WAIT,
        )
        assert record(aggregator, "pod-a").agent is not None  # still connected, just silent
        assert removals(kube_emulator) == []
        # It keeps being pulled while its agent is silent.
        fake_proxy.set(DRAINING)
        await kube_emulator.wait_until(
            lambda: label(kube_emulator, "pod-a") == "false", within=WAIT
        )
        assert record(aggregator, "pod-a").source is Source.PULL
        call.cancel()


async def test_most_agents_disconnecting_removes_no_label(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, proxies: list[FakeServeProxy]
) -> None:
    pods = add_pods(kube_emulator, proxies)
    aggregator = await start_kube(pull_interval=60)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregator.port}") as channel:
        calls = []
        for i, pod in enumerate(pods):
            call = await open_stream(channel, f"pod-{i}", uid=pod["metadata"]["uid"])
            await call.write(report(pb.SERVE_STATE_SERVING, 1, "success"))
            await call.read()
            calls.append(call)
        await kube_emulator.wait_until(
            lambda: all(label(kube_emulator, f"pod-{i}") == "true" for i in range(10)),
            within=WAIT,
        )
        for call in calls[:8]:  # 80 % of the agents vanish at once
            call.cancel()
        await eventually(
            lambda: all(record(aggregator, f"pod-{i}").source is Source.PULL for i in range(8)),
            WAIT,
        )
        assert all(record(aggregator, f"pod-{i}").state is ServeState.SERVING for i in range(10))
        assert removals(kube_emulator) == []
        assert not aggregator.core.panic
        summary = await grpcurl_summary(aggregator)
        assert summary.get("podsInPullMode", summary.get("pods_in_pull_mode")) == 8
        for call in calls[8:]:
            call.cancel()


async def test_most_proxies_hanging_is_panic_and_removes_no_label(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, proxies: list[FakeServeProxy]
) -> None:
    add_pods(kube_emulator, proxies)  # no agents: pure pull
    aggregator = await start_kube(pull_interval=0.5)
    await kube_emulator.wait_until(
        lambda: all(label(kube_emulator, f"pod-{i}") == "true" for i in range(10)), within=WAIT
    )
    for proxy in proxies[:8]:  # 80 % of the proxies hang at once
        proxy.hang = True
    await eventually(lambda: aggregator.core.summary().panic_held_writes == 8, timeout=WAIT)
    summary = await grpcurl_summary(aggregator)
    assert summary["panic"] is True
    held = summary.get("panicHeldWrites", summary.get("panic_held_writes"))
    assert held == 8, summary  # PANIC says how many writes it really holds
    assert aggregator.metrics.panic_held_writes._value.get() == 8
    # Probing goes on; the held removals never reach the API.
    unhealthy = aggregator.metrics.pull_probes.labels("UNHEALTHY")
    seen = unhealthy._value.get()
    await eventually(lambda: unhealthy._value.get() >= seen + 8, timeout=WAIT)
    assert removals(kube_emulator) == []
    assert aggregator.core.panic

    # Recovery: six proxies answer again, two stay hung, and one of the others now says 503.
    for proxy in proxies[2:8]:
        proxy.set(proxy.healthz)
    proxies[9].set(NOT_POPULATED)
    await eventually(lambda: not aggregator.core.panic, timeout=WAIT)
    # Panic over: what the probes show is applied (the two hung ones and the 503 go out).
    await kube_emulator.wait_until(
        lambda: (
            [label(kube_emulator, f"pod-{i}") for i in range(10)]
            == ["false", "false", *["true"] * 7, "false"]
        ),
        within=WAIT,
    )
    summary = await grpcurl_summary(aggregator)
    assert "panic" not in summary  # false is left out of the JSON


async def grpcurl_summary(aggregator: Aggregator) -> dict[str, Any]:
    result = await grpcurl.arun(
        [
            "-plaintext",
            f"127.0.0.1:{aggregator.port}",
            "servehealth.v1.InspectionService/GetSummary",
        ]
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("labelled", [True, False], ids=["labelled-true", "unlabelled"])
async def test_a_healthy_fleet_without_agents_starts_without_panic(
    kube_emulator: KubeEmulator,
    start_kube: StartAggregator,
    proxies: list[FakeServeProxy],
    caplog: pytest.LogCaptureFixture,
    labelled: bool,
) -> None:
    """PANIC means writes are held: a healthy fleet whose pods have no agents used to go SILENT
    all at once when the startup grace ended (before their first pull), logging PANIC and
    leaving it a few milliseconds later. The grace's end now counts as every pod's last word."""
    for i, proxy in enumerate(proxies):
        labels = {**DEFAULT_POD_LABELS, "ray.io/serve": "true"} if labelled else None
        kube_emulator.add_pod(
            "default", f"pod-{i}", pod_ip="127.0.0.1", serve_port=proxy.port, labels=labels
        )
    caplog.set_level(logging.INFO, logger="aggregator")
    aggregator = await start_kube(
        heartbeat_ttl=0.5, heartbeat_interval=0.2, startup_grace=1.0, pull_interval=1.0
    )
    pulled = aggregator.metrics.pull_probes.labels("SERVING")
    # Every pod pulled SERVING twice: past the grace, its extra TTL and a full pull interval.
    await eventually(lambda: pulled._value.get() >= 2 * len(proxies), timeout=WAIT)
    assert all(record(aggregator, f"pod-{i}").state is ServeState.SERVING for i in range(10))
    assert aggregator.core.counts()[ServeState.SILENT] == 0
    assert "PANIC" not in caplog.text
    assert not aggregator.core.panic
    assert aggregator.metrics.panic._value.get() == 0
    assert removals(kube_emulator) == []


async def test_a_pod_declaring_serve_grpc_is_pulled_on_both_proxies(
    kube_emulator: KubeEmulator, start_kube: StartAggregator, fake_proxy: FakeServeProxy
) -> None:
    """No agent: the aggregator's pulls ask the gRPC proxy too, where the pod declares one
    (container port ``serve-grpc``), and the pod is in service only when both serve."""
    grpc_proxy = await FakeGrpcServeProxy().start()
    try:
        pod = kube_emulator.add_pod(
            "default", "pod-g", pod_ip="127.0.0.1", serve_port=fake_proxy.port
        )
        containers = pod["spec"]["containers"]
        containers[0]["ports"].append({"name": "serve-grpc", "containerPort": grpc_proxy.port})
        kube_emulator.modify_pod("default", "pod-g", patch={"spec": {"containers": containers}})
        aggregator = await start_kube(pull_interval=0.2)
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-g") == "true", within=WAIT)
        assert grpc_proxy.calls > 0
        grpc_proxy.set(GRPC_DRAINING)  # HTTP still serves
        await kube_emulator.wait_until(
            lambda: label(kube_emulator, "pod-g") == "false", within=WAIT
        )
        pulled = record(aggregator, "pod-g")
        assert pulled.state is ServeState.DRAINING
        assert pulled.source is Source.PULL
        assert pulled.reason == (
            f"gRPC proxy 127.0.0.1:{grpc_proxy.port}: This node is being drained."
        )
    finally:
        await grpc_proxy.stop()
