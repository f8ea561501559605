"""The DaemonSet agent (``--mode daemonset``, ``node_agent.daemonset``) against the kmock
Kubernetes API emulator (real HTTP, official client) and real loopback Serve proxies.

- Pods on the agent's node are probed, each at its pod IP and ``serve`` port (every pod its own
  ``FakeServeProxy`` on 127.0.0.1; only 127.x pod IPs are ever used, so nothing probes a
  non-loopback address); pods on other nodes, or in namespaces not asked for, never are.
- Pods that appear are picked up; pods deleted, finished or without an IP are not probed (a
  pod waits for its IP); a change of labels alone does not restart a pod's probe. Which pods
  are probed is read from the agent's log (a line when a pod's probe starts, one when it stops)
  and from the fake proxies' request counts.
- Reports for every pod reach a real in-process aggregator (Kubernetes backend on the same
  emulator) on one stream: the pods turn SERVING and their label ``true``. Hundreds of pods go
  in batches small enough for the aggregator's message limit.
- The agent's only API calls are GET list and watch of pods, with ``spec.nodeName`` of its node.
- SidecarPod: only ``NODE_NAME`` is needed; the CLI as a real process, end to end, in JSON logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from aggregator.decision.tracker import PodRecord
from aggregator.flags import AggregatorFlags
from aggregator.server import Aggregator
from node_agent.daemonset import NodeAgent, PodTarget
from node_agent.flags import AgentFlags
from node_agent.identity import REQUIRED, MissingIdentity, node_name_from_environ
from node_agent.kube_client import USER_AGENT, make_kube_client
from node_agent.stream import MAX_BATCH_REPORTS, Outbox, ReportClient
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.grpc_healthz import GrpcHealthz
from servehealth_common.http import HTTPClient
from servehealth_common.kube.client import KubeClient
from servehealth_common.pod_identity import PodKey
from servehealth_common.probe import Prober, ProbeResult, make_session
from servehealth_common.states import ServeState
from tests.conftest import StartAggregator, eventually, running
from testsupport.fakes import GRPC_DRAINING as DRAINING_GRPC
from testsupport.fakes import FakeGrpcServeProxy, FakeServeProxy, refused_port
from testsupport.kube.emulator import ApiCall, KubeEmulator, make_pod

NODE = "node-1"
LOOPBACK = "127.0.0.1"
SELECTOR = "ray.io/node-type"

MakeNodeAgent = Callable[..., NodeAgent]
StartProxies = Callable[[int], Awaitable[list[FakeServeProxy]]]


@pytest.fixture
async def proxies() -> AsyncIterator[StartProxies]:
    """``await proxies(n)``: n healthy fake Serve proxies on loopback ports, stopped after."""
    started: list[FakeServeProxy] = []

    async def start(count: int) -> list[FakeServeProxy]:
        fresh = [await FakeServeProxy(host=LOOPBACK).start() for _ in range(count)]
        started.extend(fresh)
        return fresh

    yield start
    for proxy in started:
        await proxy.stop()


@pytest.fixture
async def session() -> AsyncIterator[HTTPClient]:
    async with make_session() as session:
        yield session


@pytest.fixture
def make_node_agent(session: HTTPClient, kubeconfig_path: pathlib.Path) -> Iterator[MakeNodeAgent]:
    """``make_node_agent(aggregator=..., **settings)``: a NodeAgent for NODE on the emulator."""
    clients: list[KubeClient] = []

    def make(aggregator: str | None = None, **overrides: Any) -> NodeAgent:
        settings = AgentFlags(
            **{
                "aggregator": aggregator or f"{LOOPBACK}:{refused_port()}",
                "mode": "daemonset",
                "kubeconfig": str(kubeconfig_path),
                "interval": 0.1,
                "probe_timeout": 0.09,
                "confirm_delay": 0.05,
                "connect_timeout": 0.5,
                "reconnect_max": 0.5,
                **overrides,
            }
        )
        client = make_kube_client(settings)
        clients.append(client)
        prober = Prober(session, settings.probe_timeout, concurrency=settings.probe_concurrency)
        return NodeAgent(settings, NODE, prober, client)

    yield make
    for client in clients:
        client.close()


#: The DaemonSet agent's log lines of a pod's probe starting (with its URL) and stopping.
PROBE_STARTED = re.compile(
    r"pod (?P<namespace>[^/\s]+)/(?P<name>\S+): probing (?P<url>\S+)(?: and gRPC (?P<grpc>\S+))?"
)
PROBE_STOPPED = re.compile(
    r"pod (?P<namespace>[^/\s]+)/(?P<name>\S+): "
    r"(?:no longer probed \(.*\)|gone from node \S+, no longer probed)"
)
#: A probe loop's log line when its pod's state changed (its first result included).
STATE_CHANGED = re.compile(
    r"pod (?P<namespace>[^/\s]+)/(?P<name>\S+) \(\S+\): (?P<state>[A-Z_]+) \("
)


@dataclass(frozen=True)
class ProbeLog:
    """What the agent logs about its probes: which pods it probes now, at which URL, and the
    state changes each probe saw (the log lines the operator reads, captured by ``caplog``)."""

    caplog: pytest.LogCaptureFixture

    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.caplog.records]

    def probed(self) -> dict[PodKey, str]:
        """The pods probed now (started and not stopped since), with the URL probed."""
        now: dict[PodKey, str] = {}
        for message in self.messages():
            if started := PROBE_STARTED.fullmatch(message):
                now[PodKey(started["namespace"], started["name"])] = started["url"]
            elif stopped := PROBE_STOPPED.fullmatch(message):
                now.pop(PodKey(stopped["namespace"], stopped["name"]), None)
        return now

    def starts(self, namespace: str, name: str) -> list[str]:
        """The URL of every probe started for the pod, in order."""
        return [
            started["url"]
            for message in self.messages()
            if (started := PROBE_STARTED.fullmatch(message))
            and (started["namespace"], started["name"]) == (namespace, name)
        ]

    def states(self, namespace: str, name: str) -> list[str]:
        """The states the pod's probes logged on a change, in order."""
        return [
            changed["state"]
            for message in self.messages()
            if (changed := STATE_CHANGED.match(message))
            and (changed["namespace"], changed["name"]) == (namespace, name)
        ]


@pytest.fixture
def probe_log(caplog: pytest.LogCaptureFixture) -> ProbeLog:
    caplog.set_level(logging.DEBUG, logger="node_agent")
    return ProbeLog(caplog)


def add_pod(
    kube: KubeEmulator,
    name: str,
    proxy: FakeServeProxy,
    *,
    node: str = NODE,
    namespace: str = "default",
    pod_ip: str | None = LOOPBACK,
) -> dict[str, Any]:
    """A Ray pod whose ``serve`` port is ``proxy``'s (``pod_ip=None``: no IP yet)."""
    return kube.add_pod(namespace, name, node_name=node, pod_ip=pod_ip, serve_port=proxy.port)


def agent_calls(kube: KubeEmulator) -> list[ApiCall]:
    """The API requests the agent made (told apart from the aggregator's by User-Agent)."""
    return [
        call
        for call in kube.requests()
        if any(k.lower() == "user-agent" and v == USER_AGENT for k, v in call.headers.items())
    ]


def record(aggregator: Aggregator, name: str) -> PodRecord | None:
    return aggregator.core.pod(PodKey("default", name))


def serving(aggregator: Aggregator, name: str) -> bool:
    found = record(aggregator, name)
    return found is not None and found.state is ServeState.SERVING


def label(kube: KubeEmulator, name: str) -> str | None:
    return kube.pod_labels("default", name).get("ray.io/serve")


async def more_probes(proxy: FakeServeProxy, count: int) -> None:
    """Wait until ``proxy`` has seen ``count`` more probes (a healthy proxy answers two requests
    per probe: healthz, then routes): the agent's probes as a clock, no sleeping."""
    target = proxy.requests + 2 * count
    await eventually(lambda: proxy.requests >= target, timeout=10)


async def start_kube_aggregator(
    start_aggregator: StartAggregator, kubeconfig_path: pathlib.Path
) -> Aggregator:
    # The startup grace holds off the aggregator's own pull probes for the whole test, so every
    # request a fake proxy counts is the agent's.
    return await start_aggregator(
        kube_backend="kubernetes",
        kubeconfig=str(kubeconfig_path),
        startup_grace=60.0,
        heartbeat_interval=0.2,
        events=False,
    )


# -- against a real aggregator ------------------------------------------------------------


async def test_pods_on_its_node_are_probed_and_reported_on_one_stream(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    start_aggregator: StartAggregator,
    make_node_agent: MakeNodeAgent,
    proxies: StartProxies,
    probe_log: ProbeLog,
) -> None:
    proxy_a, proxy_b, proxy_x = await proxies(3)
    add_pod(kube_emulator, "pod-a", proxy_a)
    add_pod(kube_emulator, "pod-b", proxy_b)
    add_pod(kube_emulator, "pod-x", proxy_x, node="node-2")
    aggregator = await start_kube_aggregator(start_aggregator, kubeconfig_path)
    agent = make_node_agent(f"{LOOPBACK}:{aggregator.port}")
    async with running(agent):
        for name in ("pod-a", "pod-b"):
            await eventually(lambda name=name: serving(aggregator, name), timeout=10)
            await kube_emulator.wait_until(lambda name=name: label(kube_emulator, name) == "true")
        # One stream carries both pods.
        records = [record(aggregator, name) for name in ("pod-a", "pod-b")]
        streams = {found.agent for found in records if found is not None}
        assert len(streams) == 1
        assert None not in streams
        assert aggregator.core.agents_connected == 1
        assert set(probe_log.probed()) == {("default", "pod-a"), ("default", "pod-b")}
        # Heartbeats keep both fresh; the pod on the other node is never probed by this agent.
        await more_probes(proxy_a, 5)
        await more_probes(proxy_b, 5)
        assert proxy_x.requests == 0
        pod_x = record(aggregator, "pod-x")
        assert pod_x is not None
        assert pod_x.state is ServeState.UNKNOWN
        assert pod_x.agent is None
        assert label(kube_emulator, "pod-x") is None

    calls = agent_calls(kube_emulator)
    assert {call.verb for call in calls} == {"list", "watch"}
    for call in calls:
        assert call.method == "GET", call
        assert (call.resource, call.group, call.subresource) == ("pods", "", None), call
        assert call.params.get("fieldSelector") == f"spec.nodeName={NODE}", call
        assert call.params.get("labelSelector") == SELECTOR, call
    # The aggregator did write, with its own User-Agent: the filter tells the two apart.
    assert any(call.method == "PATCH" for call in kube_emulator.requests())


async def test_pods_that_appear_and_vanish(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    start_aggregator: StartAggregator,
    make_node_agent: MakeNodeAgent,
    proxies: StartProxies,
    probe_log: ProbeLog,
) -> None:
    proxy_a, proxy_b, proxy_c = await proxies(3)
    add_pod(kube_emulator, "pod-a", proxy_a)
    add_pod(kube_emulator, "pod-b", proxy_b)
    aggregator = await start_kube_aggregator(start_aggregator, kubeconfig_path)
    agent = make_node_agent(f"{LOOPBACK}:{aggregator.port}")
    async with running(agent):
        await eventually(lambda: serving(aggregator, "pod-a") and serving(aggregator, "pod-b"))

        # A pod scheduled later on this node is picked up and reported.
        add_pod(kube_emulator, "pod-c", proxy_c)
        await eventually(lambda: serving(aggregator, "pod-c"), timeout=10)
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-c") == "true")
        assert proxy_c.requests > 0

        # A deleted pod stops being probed and reported; the others go on.
        kube_emulator.delete_pod("default", "pod-a")
        await eventually(lambda: ("default", "pod-a") not in probe_log.probed())
        assert ("default", "pod-a") not in agent.outbox
        await more_probes(proxy_b, 1)  # a probe in flight at the deletion has landed by now
        stopped_at = proxy_a.requests
        await more_probes(proxy_b, 5)
        assert proxy_a.requests == stopped_at
        assert record(aggregator, "pod-a") is None  # the aggregator forgot it too
        assert serving(aggregator, "pod-b")
        assert serving(aggregator, "pod-c")
        assert set(probe_log.probed()) == {("default", "pod-b"), ("default", "pod-c")}
        # Still one stream for everything: the agent is (still, or again) the one connected.
        await eventually(lambda: aggregator.core.agents_connected == 1)
        pod_b, pod_c = record(aggregator, "pod-b"), record(aggregator, "pod-c")
        assert pod_b is not None
        assert pod_c is not None
        assert pod_b.agent == pod_c.agent


async def test_many_pods_go_in_batches_the_aggregator_accepts(
    start_aggregator: StartAggregator,
) -> None:
    """300 pods with 256-byte reasons are ~90 KiB of reports: over the aggregator's 64 KiB
    message limit in one batch, fine in batches of MAX_BATCH_REPORTS."""
    assert MAX_BATCH_REPORTS < 300
    aggregator = await start_aggregator(kube_backend="memory")
    assert AggregatorFlags().max_message_bytes == 64 * 1024  # the default it runs with
    settings = AgentFlags(aggregator=f"{LOOPBACK}:{aggregator.port}", mode="daemonset")
    outbox = Outbox()
    result = ProbeResult(ServeState.NOT_READY, "x" * 256, 503, 0.0)
    for i in range(300):
        ref = pb.PodRef(namespace="default", name=f"pod-{i}", uid=f"uid-{i}")
        outbox.put(("default", f"pod-{i}"), ref, result, True)
    hello = pb.Hello(mode=pb.AGENT_MODE_DAEMONSET, node_name=NODE, agent_version="test")
    stream = ReportClient(settings, hello, outbox, who=f"node {NODE}", rng=random.Random(1))
    task = asyncio.create_task(stream.run())
    try:
        # One message this big would end the stream (RESOURCE_EXHAUSTED) on every attempt.
        await eventually(lambda: aggregator.core.counts()[ServeState.NOT_READY] == 300)
        assert aggregator.core.agents_connected == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class RecordingAggregator(pb_grpc.ReportServiceServicer):
    """Wants changes and rare resyncs (as a 0.2.0 aggregator does) and keeps every message."""

    def __init__(self) -> None:
        self.messages: list[pb.ReportBatch] = []

    async def Report(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> None:
        hello = await context.read()
        assert hello.hello.reports_on_change
        settings = pb.AgentSettings(reports_per_change=2)
        settings.heartbeat_interval.FromSeconds(1)
        settings.resync_interval.FromSeconds(600)
        await context.write(pb.AggregatorMessage(settings=settings))
        while (message := await context.read()) is not grpc.aio.EOF:
            self.messages.append(message.reports)


async def test_pods_of_a_node_that_change_together_go_in_one_message(
    kube_emulator: KubeEmulator, make_node_agent: MakeNodeAgent, proxies: StartProxies
) -> None:
    """The node's pods are probed on one grid of ticks and the stream waits a moment after a
    first change: ten pods failing at once take one message (two if the failure landed in the
    middle of a round), not ten."""
    servicer = RecordingAggregator()
    server = grpc.aio.server()
    pb_grpc.add_ReportServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    await server.start()
    started = await proxies(10)
    for i, proxy in enumerate(started):
        add_pod(kube_emulator, f"pod-{i}", proxy)
    agent = make_node_agent(aggregator=f"{LOOPBACK}:{port}")

    def reported(state: int) -> list[pb.ReportBatch]:
        return [m for m in servicer.messages if any(r.state == state for r in m.reports)]

    def pods_reported(state: int) -> set[str]:
        return {r.pod.name for m in reported(state) for r in m.reports if r.state == state}

    try:
        async with running(agent):
            await eventually(lambda: len(pods_reported(pb.SERVE_STATE_SERVING)) == 10, 10)
            await more_probes(started[-1], 3)  # the confirmations, if owed, are in by then
            quiet = len(servicer.messages)
            await more_probes(started[-1], 5)  # five rounds, nothing changes: nothing sent
            assert len(servicer.messages) == quiet
            mark = len(servicer.messages)
            for proxy in started:
                proxy.set((503, "No replicas are available yet."))
            await eventually(lambda: len(pods_reported(pb.SERVE_STATE_NOT_READY)) == 10, 10)
            changes = [
                m
                for m in servicer.messages[mark:]
                if any(r.state == pb.SERVE_STATE_NOT_READY for r in m.reports)
            ]
            first_reports = {}
            for index, message in enumerate(changes):
                for report in message.reports:
                    first_reports.setdefault(report.pod.name, index)
            assert len(set(first_reports.values())) <= 2, [len(m.reports) for m in changes]
    finally:
        await server.stop(None)


# -- what gets probed ---------------------------------------------------------------------


async def test_a_pod_waits_for_its_ip_and_keeps_its_probe_through_label_changes(
    kube_emulator: KubeEmulator,
    make_node_agent: MakeNodeAgent,
    proxies: StartProxies,
    probe_log: ProbeLog,
) -> None:
    proxy_p, proxy_q = await proxies(2)
    add_pod(kube_emulator, "pod-p", proxy_p, pod_ip=None)  # scheduled, no IP yet
    agent = make_node_agent()  # no aggregator: probing does not depend on one
    async with running(agent):
        # The list comes before the watch: pod-p was seen, and left alone.
        await kube_emulator.wait_for_watches(1)
        assert "pod default/pod-p: not probed yet (no pod IP yet)" in probe_log.messages()
        assert probe_log.probed() == {}
        kube_emulator.modify_pod("default", "pod-p", pod_ip=LOOPBACK)
        await eventually(lambda: proxy_p.requests > 0)
        url = f"http://{LOOPBACK}:{proxy_p.port}/-/healthz"
        assert probe_log.starts("default", "pod-p") == [url]
        await eventually(lambda: probe_log.states("default", "pod-p")[-1:] == ["SERVING"])

        # The aggregator writes labels on these pods: that must not restart the probe (a new
        # probe would log its start again). The watch delivers events in order, so once pod-q
        # shows up, the label change was seen.
        kube_emulator.modify_pod("default", "pod-p", labels={"ray.io/serve": "true"})
        add_pod(kube_emulator, "pod-q", proxy_q)
        await eventually(lambda: ("default", "pod-q") in probe_log.probed())
        assert probe_log.starts("default", "pod-p") == [url]
        assert ("default", "pod-p") in probe_log.probed()

        # A pod that finished is not probed any more.
        kube_emulator.modify_pod("default", "pod-p", phase="Succeeded")
        await eventually(lambda: ("default", "pod-p") not in probe_log.probed())
        assert ("default", "pod-p") not in agent.outbox
        await eventually(lambda: ("default", "pod-q") in agent.outbox)  # after its first probe


async def test_namespaces_limit_what_is_listed_and_probed(
    kube_emulator: KubeEmulator,
    make_node_agent: MakeNodeAgent,
    proxies: StartProxies,
    probe_log: ProbeLog,
) -> None:
    in_ray, in_other, in_team = await proxies(3)
    add_pod(kube_emulator, "pod-r", in_ray, namespace="ray")
    add_pod(kube_emulator, "pod-o", in_other, namespace="other")
    add_pod(kube_emulator, "pod-t", in_team, namespace="team")
    agent = make_node_agent(namespace=("ray", "team"))
    async with running(agent):
        await eventually(lambda: len(probe_log.probed()) == 2)
        assert set(probe_log.probed()) == {("ray", "pod-r"), ("team", "pod-t")}
        await more_probes(in_ray, 3)
        await more_probes(in_team, 3)
        assert in_other.requests == 0
    assert {call.namespace for call in agent_calls(kube_emulator)} == {"ray", "team"}


def test_pod_target_grpc_port_from_a_serve_grpc_container_port() -> None:
    pod = make_pod("ray", "head", node_name=NODE, pod_ip="10.0.0.7", serve_port=8000)
    assert PodTarget.from_pod(pod, default_port=8000).grpc_address is None
    assert PodTarget.from_pod(pod, 8000, default_grpc_port=9000).grpc_address == "10.0.0.7:9000"
    pod["spec"]["containers"][0]["ports"].append({"name": "serve-grpc", "containerPort": 9100})
    assert PodTarget.from_pod(pod, 8000).grpc_address == "10.0.0.7:9100"
    assert PodTarget.from_pod(pod, 8000, default_grpc_port=9000).grpc_address == "10.0.0.7:9100"
    pod["status"]["podIP"] = "fd00::7"
    assert PodTarget.from_pod(pod, 8000).grpc_address == "[fd00::7]:9100"


async def test_a_pod_declaring_serve_grpc_is_serving_only_when_both_proxies_are(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    session: HTTPClient,
    proxies: StartProxies,
    probe_log: ProbeLog,
) -> None:
    (http_proxy,) = await proxies(1)
    grpc_proxy = await FakeGrpcServeProxy().start()
    pod = add_pod(kube_emulator, "pod-g", http_proxy)
    containers = pod["spec"]["containers"]
    containers[0]["ports"].append({"name": "serve-grpc", "containerPort": grpc_proxy.port})
    kube_emulator.modify_pod("default", "pod-g", patch={"spec": {"containers": containers}})
    settings = AgentFlags(
        aggregator=f"{LOOPBACK}:{refused_port()}",
        mode="daemonset",
        kubeconfig=str(kubeconfig_path),
        interval=0.1,
        probe_timeout=0.09,
        confirm_delay=0.01,
    )
    client = make_kube_client(settings)
    healthz = GrpcHealthz(settings.probe_timeout)
    agent = NodeAgent(settings, NODE, Prober(session, 0.09, grpc=healthz), client)
    try:
        async with running(agent):
            await eventually(lambda: probe_log.states("default", "pod-g") == ["SERVING"])
            assert probe_log.probed()[PodKey("default", "pod-g")] == http_proxy.url
            assert f"and gRPC {grpc_proxy.address}" in "\n".join(probe_log.messages())
            # Both proxies asked, in the same rounds.
            await eventually(lambda: grpc_proxy.calls >= 3)
            grpc_proxy.set(DRAINING_GRPC)
            await eventually(lambda: probe_log.states("default", "pod-g")[-1] == "DRAINING")
            await grpc_proxy.stop()  # HTTP still fine: the pod's gRPC ingress is gone
            await eventually(lambda: probe_log.states("default", "pod-g")[-1] == "NO_PROXY")
    finally:
        client.close()
        await healthz.close()
        await grpc_proxy.stop()


def test_pod_target_from_a_pod() -> None:
    pod = make_pod("ray", "head", node_name=NODE, pod_ip="127.0.0.2", serve_port=8123)
    target = PodTarget.from_pod(pod, default_port=8000)
    assert target.key == ("ray", "head")
    assert target.url == "http://127.0.0.2:8123/-/healthz"
    assert target.probeable
    no_port = make_pod("ray", "worker", pod_ip="::1", serve_port=None)
    assert PodTarget.from_pod(no_port, default_port=8000).url == "http://[::1]:8000/-/healthz"


# -- identity and the CLI ---------------------------------------------------------------------


def test_daemonset_identity_needs_only_node_name() -> None:
    assert node_name_from_environ({"NODE_NAME": NODE}) == NODE
    with pytest.raises(MissingIdentity) as exc_info:
        node_name_from_environ({"POD_NAME": "x", "NODE_NAME": ""})
    message = str(exc_info.value)
    assert "environment variable NODE_NAME not set" in message
    assert "spec.nodeName" in message
    assert not any(name in message for name in REQUIRED if name != "NODE_NAME")


def clean_environ(**extra: str) -> dict[str, str]:
    """This environment without identity, SERVE_HEALTH_* or in-cluster variables."""
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in REQUIRED
        and not key.startswith(("SERVE_HEALTH_", "KUBERNETES_"))
        and key != "KUBECONFIG"
    }
    environ.update(extra)
    return environ


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param({}, "environment variable NODE_NAME not set", id="no-node-name"),
        pytest.param(
            {"NODE_NAME": NODE}, "no Kubernetes configuration: pass --kubeconfig", id="no-config"
        ),
    ],
)
def test_cli_daemonset_usage_errors_exit_2(environ: dict[str, str], expected: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "node_agent", "--mode", "daemonset", "--aggregator", "x:1"],
        env=clean_environ(**environ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2, completed.stderr
    assert f"serve-health-agent: error: {expected}" in completed.stderr
    assert "POD_NAME" not in completed.stderr


async def test_cli_daemonset_end_to_end_with_json_logs(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    start_aggregator: StartAggregator,
    proxies: StartProxies,
    tmp_path: pathlib.Path,
) -> None:
    (proxy,) = await proxies(1)
    add_pod(kube_emulator, "pod-a", proxy)
    aggregator = await start_kube_aggregator(start_aggregator, kubeconfig_path)
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "node_agent",
            "--mode=daemonset",
            f"--kubeconfig={kubeconfig_path}",
            f"--aggregator={LOOPBACK}:{aggregator.port}",
            "--interval=200ms",
            "--probe-timeout=100ms",
            "--log-format=json",
            env=clean_environ(NODE_NAME=NODE),  # no POD_* variables: not needed here
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        await eventually(lambda: serving(aggregator, "pod-a") or process.returncode, timeout=20)
        assert process.returncode is None, log_path.read_text()
        await kube_emulator.wait_until(lambda: label(kube_emulator, "pod-a") == "true")
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = log_path.read_text()
    assert process.returncode == 0, text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines), text
    messages = [line["message"] for line in lines]
    assert any(m.startswith(f"agent for node {NODE}: probing the Ray pods") for m in messages)
    assert f"connected to aggregator {LOOPBACK}:{aggregator.port} as node {NODE}" in messages
    assert f"pod default/pod-a: probing http://{LOOPBACK}:{proxy.port}/-/healthz" in messages
    assert messages[-1] == "agent stopped"
    assert {call.verb for call in agent_calls(kube_emulator)} == {"list", "watch"}
