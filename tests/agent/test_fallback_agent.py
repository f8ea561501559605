"""The agent's fallback wired into the agent (``node_agent.fallback.runner``, the stream's
listener, the flags and the metrics), in process: a real sidecar ``Agent`` against a real
in-process aggregator (gRPC on 127.0.0.1) and the kmock Kubernetes API emulator.

- The sidecar learns what to write from the aggregator's ``AgentSettings.writes`` (condition
  mode), keeps it across the stream's end, falls back ``--fallback-after`` later, reads its own
  pod and writes the condition on it; an aggregator back ends fallback at once.
- ``--fallback-after``, ``--fallback-write``, ``--fallback-label-key`` and
  ``--fallback-condition-type``, from flags and ``SERVE_HEALTH_*``, and the keys they refuse.
- ``serve_health_agent_fallback_seconds`` (computed at scrape time) and
  ``serve_health_agent_fallback_writes_total{kind,result}``.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Callable

import pytest

from node_agent.agent import Agent
from node_agent.fallback.decider import FallbackPhase
from node_agent.fallback.rules import WriteRules
from node_agent.flags import AgentFlags
from node_agent.identity import SidecarPod
from node_agent.kube_client import USER_AGENT
from node_agent.metrics import AgentMetrics
from node_agent.sink import NoMetrics
from servehealth_common import fallback_marks as marks
from servehealth_common.config import load
from servehealth_common.http import HTTPClient
from servehealth_common.probe import Prober, make_session
from tests.conftest import StartAggregator, eventually, running
from testsupport.fakes import FakeServeProxy
from testsupport.kube.emulator import KubeEmulator

GATE = "ray.io/serve-proxy-healthy"


class Clocked(NoMetrics):
    """A sink that keeps the fallback clock it is given."""

    seconds: Callable[[], float] = staticmethod(lambda: 0.0)

    def fallback_clock(self, seconds: Callable[[], float]) -> None:
        self.seconds = seconds


@pytest.fixture
async def session() -> AsyncIterator[HTTPClient]:
    async with make_session() as session:
        yield session


@pytest.fixture
async def proxy() -> AsyncIterator[FakeServeProxy]:
    started = await FakeServeProxy().start()
    yield started
    await started.stop()


async def test_the_sidecar_falls_back_with_what_the_aggregator_said(
    kube_emulator: KubeEmulator,
    kubeconfig_path: pathlib.Path,
    start_aggregator: StartAggregator,
    session: HTTPClient,
    proxy: FakeServeProxy,
) -> None:
    pod = kube_emulator.add_pod("ns", "pod-a", readiness_gates=[GATE], labels={"a": "b"})
    identity = SidecarPod("ns", "pod-a", pod["metadata"]["uid"], "node-1")
    aggregator = await start_aggregator(mode="condition")  # --agent-fallback auto: on
    settings = AgentFlags(
        aggregator=f"127.0.0.1:{aggregator.port}",
        proxy_url=proxy.url,
        kubeconfig=str(kubeconfig_path),
        fallback_after=0.5,
        interval=0.1,
        probe_timeout=0.05,
        reconnect_max=0.2,
    )
    sink = Clocked()
    agent = Agent(settings, identity, Prober(session, settings.probe_timeout), metrics=sink)
    core = agent.fallback.core
    assert core.rules is None  # no --fallback-write: only an aggregator turns it on
    async with running(agent):
        await eventually(lambda: core.phase is FallbackPhase.CONNECTED, timeout=10)
        assert core.rules == WriteRules(condition_type=GATE)
        await aggregator.stop()
        await eventually(lambda: core.phase is FallbackPhase.FALLBACK, timeout=10)
        assert core.rules == WriteRules(condition_type=GATE)  # kept after the stream's end
        await eventually(lambda: GATE in kube_emulator.pod_conditions("ns", "pod-a"), timeout=10)
        written = kube_emulator.pod_conditions("ns", "pod-a")[GATE]
        assert (written["status"], written["reason"]) == ("True", marks.CONDITION_REASON)
        assert sink.seconds() > 0
        patches = kube_emulator.requests("PATCH")
        assert [call.headers.get("User-Agent") for call in patches] == [USER_AGENT]
        # An aggregator back: fallback ends at once.
        back = await start_aggregator(mode="condition", listen=f"127.0.0.1:{aggregator.port}")
        await eventually(lambda: core.phase is FallbackPhase.CONNECTED, timeout=10)
        assert sink.seconds() == 0
        await back.stop()


def flags(*argv: str, **environ: str) -> AgentFlags:
    return load(AgentFlags, ["--aggregator", "x:1", *argv], environ, "serve-health-agent", "")


def test_fallback_flags_and_their_defaults() -> None:
    defaults = flags()
    assert (defaults.fallback_after, defaults.fallback_write) == (10.0, "")
    assert defaults.fallback_rules is None
    assert flags("--fallback-after", "0").fallback_after == 0
    assert flags(SERVE_HEALTH_FALLBACK_AFTER="2s").fallback_after == 2.0
    assert flags("--fallback-write", "condition").fallback_rules == WriteRules(
        condition_type=GATE, failure_threshold=1, success_threshold=2
    )
    assert flags(
        "--fallback-write=both", "--fallback-label-key=example.com/serve"
    ).fallback_rules == WriteRules(label_key="example.com/serve", condition_type=GATE)
    assert flags(SERVE_HEALTH_FALLBACK_WRITE="label").fallback_rules == WriteRules(
        label_key="ray.io/serve"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"fallback_write": "label", "fallback_label_key": "ray.io/node-type"},
            "KubeRay or Kubernetes relies on",
            id="kuberay-key",
        ),
        pytest.param(
            {"fallback_write": "condition", "fallback_condition_type": "Ready"},
            "the kubelet's",
            id="kubelet-condition",
        ),
        pytest.param({"fallback_after": -1.0}, "must not be negative", id="negative"),
    ],
)
def test_bad_fallback_flags_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentFlags(aggregator="x:1", **overrides)  # type: ignore[arg-type]


def test_an_unused_key_is_not_checked() -> None:
    """Keys of a kind --fallback-write does not write are not refused."""
    AgentFlags(aggregator="x:1", fallback_write="condition", fallback_label_key="ray.io/cluster")


def test_fallback_metrics() -> None:
    metrics = AgentMetrics()
    value = metrics.registry.get_sample_value
    assert value("serve_health_agent_fallback_seconds") == 0
    seconds = [0.0]
    metrics.fallback_clock(lambda: seconds[0])
    seconds[0] = 12.5
    assert value("serve_health_agent_fallback_seconds") == 12.5  # at scrape time
    metrics.fallback_write("condition", "success")
    metrics.fallback_write("event", "error")
    labels = {"kind": "condition", "result": "success"}
    assert value("serve_health_agent_fallback_writes_total", labels) == 1
    assert value("serve_health_agent_fallback_writes_total", {"kind": "event", "result": "error"})


def test_the_gate_and_budget_metrics() -> None:
    metrics = AgentMetrics()
    value = metrics.registry.get_sample_value
    renewed, slot = [1.0], [5.0]
    metrics.fallback_gauges(lambda: renewed[0], lambda: slot[0])
    assert value("serve_health_agent_fallback_lease_renewed") == 1
    assert value("serve_health_agent_fallback_api_slot_seconds") == 5
    renewed[0], slot[0] = 0.0, 550.0  # at scrape time
    assert value("serve_health_agent_fallback_lease_renewed") == 0
    assert value("serve_health_agent_fallback_api_slot_seconds") == 550
    metrics.fallback_waited(2.5)
    metrics.fallback_waited(1.0)
    assert value("serve_health_agent_fallback_api_wait_seconds_total") == 3.5


@pytest.mark.parametrize(
    "overrides",
    [{"fallback_api_budget": 0.0}, {"fallback_fleet_size": 0}],
    ids=["no-budget", "no-fleet"],
)
def test_a_budget_or_fleet_of_nothing_is_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="--fallback-api-budget must be positive"):
        AgentFlags(aggregator="x:1", **overrides)  # type: ignore[arg-type]
