"""The agent's own endpoint (``--metrics-listen``): ``/livez``, ``/readyz`` and ``/metrics``.

- A real sidecar agent (real ``Prober``, a ``FakeServeProxy`` on loopback) with its endpoint on
  127.0.0.1:0, against a real in-process aggregator: ``serve_health_agent_connected`` goes 1,
  then 0 when the aggregator stops; the state set ``serve_health_agent_probe_state`` follows the
  proxy (SERVING, then NOT_READY on a 503); the probe-turn histogram counts, a confirmed failure
  in a slower bucket; ``serve_health_agent_pods``; the stream counters.
- ``/readyz`` never depends on the aggregator: a sidecar with none to reach is ready at once; a
  DaemonSet agent (against the kmock Kubernetes emulator) only once its first pod list
  succeeded, while no aggregator exists at all. A pod that leaves its node leaves the metrics.
- ``/livez``: 200, and 503 with the watchdog's reason while the watchdog (on a fake clock)
  finds the agent stalled.
- The flag: validation and its environment variable; the pure modules import no
  prometheus_client (only ``node_agent.metrics`` does).
- The real ``python -m node_agent`` process: /readyz, /livez and /metrics answer; a port already
  taken is one clear error (address, flag, reason) and exit status 1.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import pathlib
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from node_agent.agent import Agent
from node_agent.daemonset import NodeAgent
from node_agent.flags import AgentFlags
from node_agent.identity import REQUIRED, SidecarPod
from node_agent.kube_client import make_kube_client
from node_agent.metrics import AgentMetrics, serving
from node_agent.watchdog import Watchdog
from servehealth_common.config import load
from servehealth_common.http import HTTPClient
from servehealth_common.kube.client import KubeClient
from servehealth_common.probe import Prober, make_session
from tests.conftest import FakeClock, StartAggregator, eventually, running
from testsupport import fakes
from testsupport.fakes import FakeServeProxy, refused_port
from testsupport.kube.emulator import KubeEmulator
from testsupport.processes import StderrLines

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
IDENTITY = SidecarPod("ns", "pod-a", "uid-1", "node-1")
IDENTITY_ENV = {"POD_NAMESPACE": "ns", "POD_NAME": "pod-a", "POD_UID": "uid-1", "NODE_NAME": "n"}
NODE = "node-1"
STATES = ("serving", "not_ready", "draining", "no_proxy", "unhealthy")
#: Fast probing: a confirmed failure takes at least CONFIRM_DELAY.
FAST = {"interval": 0.1, "probe_timeout": 0.09, "confirm_delay": 0.05}
#: The agent's log line with the endpoint's address.
SERVING_ON = re.compile(r"serving /livez, /readyz and /metrics on 127\.0\.0\.1:(\d+)")


# -- reading the endpoint -------------------------------------------------------------------


async def get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(f"http://{LOOPBACK}:{port}{path}") as response,
    ):
        return response.status, await response.text()


class Scrape:
    """One scrape of ``/metrics``: every sample by name and labels."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))

    def state_set(self, namespace: str, pod: str) -> dict[str, float]:
        """``serve_health_agent_probe_state`` of one pod: state -> value."""
        found: dict[str, float] = {}
        for (name, labels), value in self.samples.items():
            tags = dict(labels)
            if name == "serve_health_agent_probe_state" and (tags["namespace"], tags["pod"]) == (
                namespace,
                pod,
            ):
                found[tags["state"]] = value
        return found

    def probed_pods(self) -> set[tuple[str, str]]:
        return {
            (dict(labels)["namespace"], dict(labels)["pod"])
            for name, labels in self.samples
            if name == "serve_health_agent_probe_state"
        }

    def turns(self, le: str | None = None) -> float:
        """Probe turns counted (``le``: in that bucket and below)."""
        if le is None:
            value = self.value("serve_health_agent_probe_duration_seconds_count")
        else:
            value = self.value("serve_health_agent_probe_duration_seconds_bucket", le=le)
        assert value is not None
        return value


async def scrape(port: int) -> Scrape:
    status, text = await get(port, "/metrics")
    assert status == 200, text
    return Scrape(text)


def only(state: str) -> dict[str, float]:
    """A state set with ``state`` current."""
    return {name: 1.0 if name == state else 0.0 for name in STATES}


async def state_becomes(port: int, namespace: str, pod: str, state: str) -> None:
    async def check() -> bool:
        return (await scrape(port)).state_set(namespace, pod) == only(state)

    await eventually(check, timeout=10)


async def value_becomes(port: int, name: str, expected: float) -> None:
    async def check() -> bool:
        return (await scrape(port)).value(name) == expected

    await eventually(check, timeout=10)


# -- agents with their endpoint -------------------------------------------------------------


@pytest.fixture
async def session() -> AsyncIterator[HTTPClient]:
    async with make_session() as session:
        yield session


@contextlib.asynccontextmanager
async def sidecar(
    session: HTTPClient, aggregator: str, proxy_url: str, watchdog: Watchdog | None = None
) -> AsyncIterator[int]:
    """A sidecar agent and its endpoint on 127.0.0.1:0, both running; yields the port."""
    settings = AgentFlags(
        aggregator=aggregator,
        proxy_url=proxy_url,
        connect_timeout=0.5,
        reconnect_max=0.2,
        metrics_listen=f"{LOOPBACK}:0",
        **FAST,
    )
    metrics = AgentMetrics()
    prober = Prober(session, settings.probe_timeout)
    agent = Agent(settings, IDENTITY, prober, watchdog=watchdog, metrics=metrics)
    async with serving(settings.metrics_listen, metrics, agent, watchdog) as server, running(agent):
        yield server.address[1]


async def test_sidecar_metrics_follow_the_proxy_and_the_stream(
    session: HTTPClient, start_aggregator: StartAggregator, fake_proxy: FakeServeProxy
) -> None:
    aggregator = await start_aggregator(kube_backend="memory")
    async with sidecar(session, f"{LOOPBACK}:{aggregator.port}", fake_proxy.url) as port:
        assert await get(port, "/readyz") == (200, "ok\n")  # at once: it knows its one proxy
        assert await get(port, "/livez") == (200, "ok\n")
        await value_becomes(port, "serve_health_agent_connected", 1.0)
        await state_becomes(port, "ns", "pod-a", "serving")
        first = await scrape(port)
        assert first.probed_pods() == {("ns", "pod-a")}
        assert first.value("serve_health_agent_pods") == 1.0
        assert first.value("serve_health_agent_stream_connections_total") == 1.0
        assert first.value("serve_health_agent_stream_failures_total") == 0.0

        # Every turn is counted, its duration in the histogram.
        async def three_more_turns() -> Scrape | None:
            found = await scrape(port)
            return found if found.turns() >= first.turns() + 3 else None

        later = await eventually(three_more_turns, timeout=10)
        assert later.turns(le="+Inf") == later.turns()
        duration_sum = later.value("serve_health_agent_probe_duration_seconds_sum")
        assert duration_sum is not None
        assert duration_sum > 0

        # A 503 from the proxy: NOT_READY, after a confirmation (a turn of two probes and the
        # confirm delay, 50 ms: above the 25 ms bucket whatever the machine's load).
        slow_before = later.turns() - later.turns(le="0.025")
        fake_proxy.set(fakes.NO_REPLICAS)
        await state_becomes(port, "ns", "pod-a", "not_ready")
        failed = await scrape(port)
        assert failed.turns() - failed.turns(le="0.025") >= slow_before + 1

        # The aggregator goes away: not connected, the failures counted; still ready and live.
        await aggregator.stop()
        await value_becomes(port, "serve_health_agent_connected", 0.0)
        gone = await scrape(port)
        failures = gone.value("serve_health_agent_stream_failures_total")
        assert failures is not None
        assert failures >= 1
        assert gone.value("serve_health_agent_stream_connections_total") == 1.0
        assert await get(port, "/readyz") == (200, "ok\n")
        assert await get(port, "/livez") == (200, "ok\n")
        # Probing goes on without an aggregator.
        fake_proxy.set(fakes.HEALTHY)
        await state_becomes(port, "ns", "pod-a", "serving")


async def test_a_sidecar_is_ready_without_any_aggregator(
    session: HTTPClient, fake_proxy: FakeServeProxy
) -> None:
    async with sidecar(session, f"{LOOPBACK}:{refused_port()}", fake_proxy.url) as port:
        assert await get(port, "/readyz") == (200, "ok\n")
        assert await get(port, "/livez") == (200, "ok\n")

        async def failed_twice() -> bool:
            failures = (await scrape(port)).value("serve_health_agent_stream_failures_total")
            return failures is not None and failures >= 2

        await eventually(failed_twice, timeout=10)
        await state_becomes(port, "ns", "pod-a", "serving")
        metrics = await scrape(port)
        assert metrics.value("serve_health_agent_connected") == 0.0
        assert metrics.value("serve_health_agent_stream_connections_total") == 0.0
        assert await get(port, "/readyz") == (200, "ok\n")


async def test_livez_fails_while_the_watchdog_finds_the_agent_stalled(
    session: HTTPClient, fake_proxy: FakeServeProxy
) -> None:
    """The watchdog on a fake clock, beaten by the agent's probe loop but by no event-loop beat
    (that task is the command line's): moving the clock past its timeout is a stall."""
    clock = FakeClock()
    dog = Watchdog(3.0, clock)
    async with sidecar(session, f"{LOOPBACK}:{refused_port()}", fake_proxy.url, dog) as port:
        assert await get(port, "/livez") == (200, "ok\n")
        clock.advance(3.5)
        assert await get(port, "/livez") == (503, "its event loop has not run for 3.5s\n")
        assert await get(port, "/readyz") == (200, "ok\n")  # readiness is another question
        dog.loop_beat()
        dog.probed()
        assert await get(port, "/livez") == (200, "ok\n")


# -- DaemonSet mode -------------------------------------------------------------------------


@pytest.fixture
def kube_clients() -> Iterator[list[KubeClient]]:
    clients: list[KubeClient] = []
    yield clients
    for client in clients:
        client.close()


async def test_a_daemonset_agent_is_ready_after_its_first_pod_list(
    session: HTTPClient,
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    kube_clients: list[KubeClient],
) -> None:
    proxies = [await FakeServeProxy(host=LOOPBACK).start() for _ in range(2)]
    try:
        for name, proxy in zip(("pod-a", "pod-b"), proxies, strict=True):
            kube_emulator.add_pod(
                "default", name, node_name=NODE, pod_ip=LOOPBACK, serve_port=proxy.port
            )
        unavailable = kube_emulator.fail_next(10_000, status=503, verb="list")
        settings = AgentFlags(
            aggregator=f"{LOOPBACK}:{refused_port()}",  # no aggregator at all
            mode="daemonset",
            kubeconfig=str(kubeconfig_path),
            connect_timeout=0.5,
            reconnect_max=0.5,
            metrics_listen=f"{LOOPBACK}:0",
            **FAST,
        )
        client = make_kube_client(settings)
        kube_clients.append(client)
        metrics = AgentMetrics()
        prober = Prober(session, settings.probe_timeout, concurrency=settings.probe_concurrency)
        agent = NodeAgent(settings, NODE, prober, client, metrics=metrics)
        async with (
            serving(settings.metrics_listen, metrics, agent, None) as server,
            running(agent),
        ):
            port = server.address[1]
            await kube_emulator.wait_until(lambda: len(unavailable) >= 1, within=10)
            status, why = await get(port, "/readyz")
            assert (status, why) == (
                503,
                f"the first list of the Ray pods of node {NODE} has not succeeded yet\n",
            )
            assert await get(port, "/livez") == (200, "ok\n")
            waiting = await scrape(port)
            assert waiting.value("serve_health_agent_pods") == 0.0
            assert waiting.probed_pods() == set()

            kube_emulator.clear_faults()  # the list is retried with backoff, and succeeds

            async def ready() -> bool:
                return (await get(port, "/readyz")) == (200, "ok\n")

            await eventually(ready, timeout=15)
            await state_becomes(port, "default", "pod-a", "serving")
            await state_becomes(port, "default", "pod-b", "serving")
            assert (await scrape(port)).value("serve_health_agent_pods") == 2.0

            # A pod that leaves the node leaves the metrics; the other stays.
            kube_emulator.delete_pod("default", "pod-a")

            async def only_pod_b() -> bool:
                return (await scrape(port)).probed_pods() == {("default", "pod-b")}

            await eventually(only_pod_b, timeout=10)
            after = await scrape(port)
            assert after.value("serve_health_agent_pods") == 1.0
            assert after.state_set("default", "pod-b") == only("serving")
            assert after.value("serve_health_agent_connected") == 0.0
            assert await get(port, "/readyz") == (200, "ok\n")
    finally:
        for proxy in proxies:
            await proxy.stop()


# -- the flag and the imports ---------------------------------------------------------------


def test_metrics_listen_is_off_by_default_and_read_from_the_environment() -> None:
    assert AgentFlags(aggregator="x:1").metrics_listen == ""
    environ = {"SERVE_HEALTH_METRICS_LISTEN": "0.0.0.0:9100"}
    flags = load(AgentFlags, ["--aggregator", "x:1"], environ, "serve-health-agent", "")
    assert flags.metrics_listen == "0.0.0.0:9100"
    given = ["--aggregator", "x:1", "--metrics-listen", "[::1]:0"]
    assert load(AgentFlags, given, environ, "serve-health-agent", "").metrics_listen == "[::1]:0"


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        pytest.param("127.0.0.1:99999", "is not a TCP port", id="port-too-large"),
        pytest.param("9100", "not a HOST:PORT address", id="no-host"),
        pytest.param("300.0.0.1:9100", "'300.0.0.1' is not an IPv4 address", id="bad-ipv4"),
    ],
)
def test_a_bad_metrics_listen_is_refused_naming_the_flag(address: str, expected: str) -> None:
    with pytest.raises(ValueError, match="--metrics-listen") as refused:
        AgentFlags(aggregator="x:1", metrics_listen=address)
    assert expected in str(refused.value)


def test_only_node_agent_metrics_imports_prometheus_client() -> None:
    """The probe loops, the stream and the agents talk to a MetricsSink (node_agent.sink)."""
    importers = set()
    for path in sorted((ROOT / "node_agent").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name.split(".")[0] == "prometheus_client" for name in names):
                importers.add(path.name)
    assert importers == {"metrics.py"}


# -- the real command -----------------------------------------------------------------------


def agent_environ() -> dict[str, str]:
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in REQUIRED and not key.startswith("SERVE_HEALTH_")
    }
    return {**environ, **IDENTITY_ENV}


def agent_command(*args: str, proxy_url: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "node_agent",
        f"--aggregator={LOOPBACK}:{refused_port()}",
        f"--proxy-url={proxy_url}",
        "--interval=200ms",
        "--probe-timeout=100ms",
        *args,
    ]


async def test_the_agent_process_serves_its_endpoint(fake_proxy: FakeServeProxy) -> None:
    process = await asyncio.create_subprocess_exec(
        *agent_command(f"--metrics-listen={LOOPBACK}:0", proxy_url=fake_proxy.url),
        env=agent_environ(),
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    stderr = StderrLines(process)
    try:
        found: Any = await stderr.line_where(SERVING_ON.search)
        port = int(found[1])
        assert await get(port, "/readyz") == (200, "ok\n")
        assert await get(port, "/livez") == (200, "ok\n")  # with the real watchdog on
        await state_becomes(port, "ns", "pod-a", "serving")
        metrics = await scrape(port)
        assert metrics.value("serve_health_agent_connected") == 0.0
        assert metrics.value("serve_health_agent_pods") == 1.0
        assert metrics.turns() >= 1
        rest = await stderr.stop()
        assert process.returncode == 0, "".join(stderr.lines) + rest
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_a_taken_metrics_port_is_one_clear_error_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        completed = subprocess.run(
            agent_command(
                f"--metrics-listen={LOOPBACK}:{port}",
                proxy_url=f"http://{LOOPBACK}:{refused_port()}/-/healthz",
            ),
            env=agent_environ(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert completed.returncode == 1, completed.stderr
    expected = (
        f"cannot start: cannot listen on {LOOPBACK}:{port} (--metrics-listen): "
        "address already in use"
    )
    errors = [line for line in completed.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, completed.stderr
    assert errors[0].endswith(expected), completed.stderr
    assert "Traceback" not in completed.stderr
    assert "connected to aggregator" not in completed.stderr
