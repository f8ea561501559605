"""Agents as the fallback decider (issue 18), with the real programs: real
``serve-health-aggregator`` and ``serve-health-agent`` processes on the Kubernetes API emulator
(kmock over real HTTP), each agent probing a real loopback ``FakeServeProxy``, with
``--fallback-after 2s``. Agent and aggregator requests are told apart by their User-Agent.

- Condition mode (and both), sidecars: while the aggregator runs, agents make zero writes.
  Once it is stopped, a new gated pod enters service through its own agent (fallback begun,
  then the write), a pod whose proxy answers 503 leaves service, a pod whose proxy hangs
  stays. An aggregator back: the agents stop writing, the aggregator writes nothing that was
  already right, and no pod flaps (each pod's history of condition PATCHes), in
  condition-only mode as in both (the aggregator seeds a gated pod from its condition, not
  from a label it does not write).
- Label mode (the agent's own ``--fallback-write label``, no aggregator ever): the label with
  the annotation of an agent's write, an Event, in and out.
- How long a fallback takes to begin and to write is printed, not bounded: a figure, for a
  benchmark (bench/ has none for fallback yet). The waits are generous (``WAIT``): only a hang
  takes that long, and the tests pass on a loaded machine.
- A DaemonSet agent writes for the pods on its node, never for a pod on another node.
- A crafted setting (a fake aggregator's ``WriteSettings`` naming ``ray.io/node-type``, or the
  kubelet's ``Ready`` condition) is refused: nothing is written, not even what the agent's own
  flags say (an aggregator's settings win over them).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common import fallback_marks as marks
from tests.conftest import eventually
from testsupport import harness
from testsupport.fakes import HEALTHY, FakeServeProxy, refused_port
from testsupport.kube.agent_processes import (
    AGENT_ARGS,
    AGENT_UA,
    FAILING,
    FALLBACK_BEGAN,
    GATE,
    LABEL,
    STARTED,
    add_pod,
    condition,
    spawn_sidecar,
    user_agent,
    writes_by,
)
from testsupport.kube.emulator import KubeEmulator

ENDPOINT = re.compile(r"serving /livez, /readyz and /metrics on [^:\s]+:(\d+)")
FALLBACK_SECONDS = "serve_health_agent_fallback_seconds"
LABEL_WRITES = 'serve_health_agent_fallback_writes_total{kind="label",result="success"}'
FALLBACK_ENDED = re.compile(r"an aggregator accepted the stream after .* of fallback")
WROTE = re.compile(r"no aggregator: wrote ")
#: How long a test waits for what real processes do: only a hang takes this long.
WAIT = 30.0


def condition_history(kube: KubeEmulator, name: str) -> list[tuple[str, str]]:
    """Every condition status PATCHed on the pod, in order, with who sent it."""
    history = []
    for call in kube.requests("PATCH", resource="pods", subresource="status", name=name):
        for written in (call.body or {}).get("status", {}).get("conditions", []):
            if written.get("type") == GATE:
                who = "agent" if user_agent(call).startswith(AGENT_UA) else "aggregator"
                history.append((who, written["status"]))
    return history


def log_count(process: harness.Process, pattern: re.Pattern[str]) -> int:
    return len(pattern.findall(process.log_text()))


def first_line(process: harness.Process, pattern: re.Pattern[str]) -> int:
    """The number of the first line of ``process``'s log that matches ``pattern``."""
    lines = process.log_text().splitlines()
    found = [number for number, line in enumerate(lines) if pattern.search(line)]
    assert found, f"no line matches {pattern.pattern!r}\n{process.tail()}"
    return found[0]


async def more_requests(proxy: FakeServeProxy, count: int) -> None:
    """Wait until ``proxy`` has seen ``count`` more requests: the agent's probes as a clock."""
    target = proxy.requests + count
    await eventually(lambda: proxy.requests >= target, timeout=WAIT)


@pytest.fixture
async def proxies() -> AsyncIterator[Callable[[int], Any]]:
    started: list[FakeServeProxy] = []

    async def start(count: int) -> list[FakeServeProxy]:
        fresh = [await FakeServeProxy().start() for _ in range(count)]
        started.extend(fresh)
        return fresh

    yield start
    for proxy in started:
        await proxy.stop()


@pytest.fixture
def processes() -> Any:
    """Processes to stop at teardown (in reverse order)."""
    running: list[harness.Process] = []
    yield running
    for process in reversed(running):
        process.stop()


@pytest.mark.parametrize("mode", ["condition", "both"])
async def test_no_aggregator_then_one_back(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: Callable[[int], Any],
    processes: list[harness.Process],
    tmp_path: Path,
    mode: str,
) -> None:
    kube = kube_emulator
    loop = asyncio.get_running_loop()
    p0, p1, p2 = await proxies(3)
    pod0 = add_pod(kube, "pod-0", p0, readiness_gates=[GATE])
    pod1 = add_pod(kube, "pod-1", p1, readiness_gates=[GATE])
    aggregator_args = [
        "--kube-backend=kubernetes",
        f"--kubeconfig={kubeconfig_path}",
        f"--mode={mode}",
        "--agent-fallback=auto",  # on, in condition and both modes
    ]
    first = await asyncio.to_thread(
        harness.start_aggregator, tmp_path / "first", None, aggregator_args
    )
    processes.append(first)
    a0 = spawn_sidecar(tmp_path, first.address, p0, pod0, kubeconfig_path)
    a1 = spawn_sidecar(tmp_path, first.address, p1, pod1, kubeconfig_path)
    processes += [a0, a1]
    await asyncio.to_thread(harness.wait_connected, a0)
    await asyncio.to_thread(harness.wait_connected, a1)
    await eventually(lambda: condition(kube, "pod-0") == condition(kube, "pod-1") == "True", WAIT)

    # Every aggregator stopped.
    stopping = loop.time()
    await asyncio.to_thread(first.stop)
    stopped = loop.time()
    # While an aggregator was there: none at all.
    assert [call for call in writes_by(kube, agent=True) if call.at < stopping] == []
    # A new gated pod, whose agent never reached an aggregator: its own flags.
    pod2 = add_pod(kube, "pod-2", p2, readiness_gates=[GATE])
    a2 = spawn_sidecar(
        tmp_path, first.address, p2, pod2, kubeconfig_path, f"--fallback-write={mode}"
    )
    processes.append(a2)
    p0.set(FAILING)
    p1.hang = True
    await eventually(lambda: STARTED.search(a2.log_text()), WAIT)
    started = loop.time()  # the agent process runs (its own clock starts about here)
    await eventually(lambda: condition(kube, "pod-2") == "True", WAIT)
    entered = loop.time() - started
    await eventually(lambda: condition(kube, "pod-0") == "False", WAIT)
    left = loop.time() - stopped
    await more_requests(p1, 4)  # the hung proxy's probes time out, again and again
    assert condition(kube, "pod-1") == "True"
    for agent in (a0, a1, a2):
        assert log_count(agent, FALLBACK_BEGAN) == 1, agent.tail()
    assert "no aggregator: wrote condition" in a0.log_text()
    # The new pod entered service by its agent's fallback: begun, then written (how soon is
    # printed: a figure, not a bound).
    assert first_line(a2, FALLBACK_BEGAN) < first_line(a2, WROTE)
    print(f"new pod in service {entered:.2f}s after its agent started; failing pod out {left:.2f}s")

    # An aggregator back (on the address the agents know), finding what they wrote.
    p1.set(HEALTHY)
    await more_requests(p1, 4)
    second = await asyncio.to_thread(
        harness.start_aggregator, tmp_path / "second", first.port, aggregator_args
    )
    back = loop.time()
    processes.append(second)
    for agent in (a0, a1, a2):
        await eventually(lambda agent=agent: log_count(agent, FALLBACK_ENDED) == 1, WAIT)
    reconnected = loop.time()
    async with grpc.aio.insecure_channel(second.address) as channel:
        inspection = pb_grpc.InspectionServiceStub(channel)

        async def judged() -> bool:
            summary = await inspection.GetSummary(pb.GetSummaryRequest(), timeout=10)
            states = summary.pods_by_state
            return (states["SERVE_STATE_SERVING"], states["SERVE_STATE_NOT_READY"]) == (2, 1)

        await eventually(judged, WAIT)
    await more_requests(p0, 6)  # a few more rounds of reports
    # The agents stopped writing; what they wrote stands.
    assert [c for c in writes_by(kube, agent=True, since=reconnected) if c.resource == "pods"] == []
    assert [condition(kube, f"pod-{i}") for i in range(3)] == ["False", "True", "True"]
    events = [e for e in kube.events("default") if e["reason"] == marks.EVENT_REASON]
    per_write = 2 if mode == "both" else 1
    told = sorted((e["involvedObject"]["name"], e["type"]) for e in events)
    assert told[:per_write] == [("pod-0", "Warning")] * per_write
    # pod-2's agent never heard an aggregator's fleet size: it spends a fleet of 100's share
    # (a slot every 5 s), and an Event not sent when an aggregator is back is not sent at all.
    assert len(told[per_write:]) <= per_write
    assert set(told[per_write:]) <= {("pod-2", "Normal")}
    if mode == "both":
        labels = [kube.pod_labels("default", f"pod-{i}").get(LABEL) for i in range(3)]
        assert labels == ["false", "true", "true"]
    # The aggregator writes nothing that was already right: no pod flaps.
    rewritten = [(c.name, c.body) for c in writes_by(kube, agent=False, since=back)]
    rewritten = [(name, body) for name, body in rewritten if name and name.startswith("pod-")]
    assert rewritten == [], "the aggregator rewrote what was already right"
    assert condition_history(kube, "pod-0") == [("aggregator", "True"), ("agent", "False")]
    # The hung pod never left service (a hang decides nothing for an agent). A sidecar whose
    # last PodView came before the aggregator's write (it stopped ~10 ms after it, once in CI)
    # may send "True" on that older version: refused (409), or the same value, never a flap.
    history = condition_history(kube, "pod-1")
    assert history[0] == ("aggregator", "True")
    assert {status for _, status in history} == {"True"}
    assert condition_history(kube, "pod-2") == [("agent", "True")]
    reasons = {kube.pod_conditions("default", f"pod-{i}")[GATE]["reason"] for i in (0, 2)}
    assert reasons == {marks.CONDITION_REASON}


async def test_label_mode_with_the_agents_own_flags(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: Callable[[int], Any],
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    loop = asyncio.get_running_loop()
    [proxy] = await proxies(1)
    pod = add_pod(kube, "worker", proxy)
    nowhere = f"127.0.0.1:{refused_port()}"
    agent = spawn_sidecar(
        tmp_path,
        nowhere,
        proxy,
        pod,
        kubeconfig_path,
        "--fallback-write=label",
        "--metrics-listen=127.0.0.1:0",
    )
    processes.append(agent)
    await eventually(lambda: STARTED.search(agent.log_text()), WAIT)
    started = loop.time()
    await eventually(lambda: kube.pod_labels("default", "worker").get(LABEL) == "true", WAIT)
    entered = loop.time() - started
    annotation = kube.pod("default", "worker")["metadata"]["annotations"][marks.ANNOTATION]
    assert annotation.endswith(" default/worker (sidecar)")
    proxy.set(FAILING)
    await eventually(lambda: kube.pod_labels("default", "worker").get(LABEL) == "false", WAIT)
    patches = kube.requests("PATCH", resource="pods", subresource=None, name="worker")
    assert [call.body["metadata"]["labels"] for call in patches] == [
        {LABEL: "true"},
        {LABEL: "false"},
    ]
    assert all(marks.ANNOTATION in call.body["metadata"]["annotations"] for call in patches)
    assert kube.requests("PATCH", subresource="status") == []  # label mode only
    events = await eventually(lambda: len(kube.events("default")) == 2 and kube.events(), WAIT)
    assert [(e["reason"], e["type"]) for e in events] == [
        (marks.EVENT_REASON, "Normal"),
        (marks.EVENT_REASON, "Warning"),
    ]
    assert all("no aggregator" in e["message"] for e in events)
    assert kube.pod_labels("default", "worker")["ray.io/node-type"] == "worker"
    port = int(ENDPOINT.search(agent.log_text())[1])
    in_fallback = await asyncio.to_thread(harness.metric_value, port, FALLBACK_SECONDS)
    assert in_fallback is not None
    assert in_fallback > 0
    assert await asyncio.to_thread(harness.metric_value, port, LABEL_WRITES) == 2
    text = agent.log_text()
    assert "no aggregator for 2s: writing for my 1 pod myself" in text
    assert text.count("no aggregator: wrote label ray.io/serve=") == 2
    # In service by the agent's fallback: begun, then written (how soon is printed, not bound).
    assert first_line(agent, FALLBACK_BEGAN) < first_line(agent, WROTE)
    print(f"in service {entered:.2f}s after the agent started")


async def test_a_daemonset_agent_writes_for_its_node_only(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: Callable[[int], Any],
    processes: list[harness.Process],
    tmp_path: Path,
) -> None:
    kube = kube_emulator
    mine, other = await proxies(2)
    add_pod(kube, "mine", mine, readiness_gates=[GATE], node_name="node-1")
    add_pod(kube, "other", other, readiness_gates=[GATE], node_name="node-2")
    agent = harness.spawn_daemonset_agent(
        tmp_path,
        f"127.0.0.1:{refused_port()}",
        kubeconfig_path,
        "node-1",
        extra_args=[*AGENT_ARGS, "--fallback-write=condition"],
    )
    processes.append(agent)
    await eventually(lambda: condition(kube, "mine") == "True", WAIT)
    await more_requests(mine, 6)
    assert condition(kube, "other") is None
    assert other.requests == 0  # never probed either
    touched = {call.name for call in writes_by(kube, agent=True) if call.resource == "pods"}
    assert touched == {"mine"}
    assert "writing for my 1 pod myself" in agent.log_text()


class CraftedAggregator(pb_grpc.ReportServiceServicer):
    """Accepts one stream with crafted write settings, then refuses every other."""

    def __init__(self, writes: pb.WriteSettings) -> None:
        self.writes = writes
        self.streams = 0

    async def Report(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        self.streams += 1
        await anext(aiter(requests))  # the hello (before any refusal: ReportService._hello_sent)
        if self.streams > 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not today")
        settings = pb.AgentSettings(writes=self.writes)
        settings.resync_interval.FromSeconds(30)
        yield pb.AggregatorMessage(settings=settings)


@pytest.mark.parametrize(
    "writes",
    [
        pytest.param(
            pb.WriteSettings(label=True, label_key="ray.io/node-type", fallback=True),
            id="kuberay-label-key",
        ),
        pytest.param(
            pb.WriteSettings(condition=True, condition_type="Ready", fallback=True),
            id="kubelet-condition",
        ),
    ],
)
async def test_a_crafted_setting_is_refused(
    kube_emulator: KubeEmulator,
    kubeconfig_path: Path,
    proxies: Callable[[int], Any],
    processes: list[harness.Process],
    tmp_path: Path,
    writes: pb.WriteSettings,
) -> None:
    kube = kube_emulator
    [proxy] = await proxies(1)
    pod = add_pod(kube, "worker", proxy, readiness_gates=["Ready", GATE])
    conditions = kube.pod_conditions("default", "worker")
    crafted = CraftedAggregator(writes)
    server = grpc.aio.server()
    pb_grpc.add_ReportServiceServicer_to_server(crafted, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        agent = spawn_sidecar(
            tmp_path,
            f"127.0.0.1:{port}",
            proxy,
            pod,
            kubeconfig_path,
            "--fallback-write=condition",  # the flags would write; the setting wins, refused
            "--fallback-after=1s",
        )
        processes.append(agent)
        await eventually(lambda: crafted.streams >= 2, WAIT)  # accepted once, then refused
    finally:
        await server.stop(None)
    await more_requests(proxy, 2 * round(2.0 / 0.3))  # probes for 2s: well past fallback-after
    assert "refusing the aggregator's write settings" in agent.log_text()
    assert writes_by(kube, agent=True) == []
    assert kube.pod_labels("default", "worker")["ray.io/node-type"] == "worker"
    assert kube.pod_conditions("default", "worker") == conditions
    assert GATE not in conditions
