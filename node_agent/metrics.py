"""The agent's own HTTP endpoint (``--metrics-listen``): ``/livez``, ``/readyz`` and Prometheus
``/metrics``, on a registry of its own (no global state).

The only module of the agent that imports prometheus_client, and the command line loads it only
with ``--metrics-listen``: without the flag the agent's footprint is what it was (with it, about
4 MiB more RSS, mostly prometheus_client's imports: bench/agent_footprint.py --metrics).
:class:`AgentMetrics` is the :class:`~node_agent.sink.MetricsSink` the probe loops and the
stream call. Per probe turn that is one dict write and one histogram observation; the state
set and the pod count are rendered at scrape time, from the dict.

- ``serve_health_agent_connected``: 1 while a Report stream is open and accepted, else 0.
- ``serve_health_agent_probe_state{namespace,pod,state}``: a state set, kube-state-metrics
  style: for each pod probed (once it has a result), one series per state an agent reports,
  named as in the proto without ``SERVE_STATE_``, lowercased (``serving``, ``not_ready``,
  ``draining``, ``no_proxy``, ``unhealthy``): 1 for its current state, 0 for the others. A pod
  that leaves the agent's view leaves the metric.
- ``serve_health_agent_probe_duration_seconds``: histogram of probe turns of one pod (a
  confirmed failure: both probes and the delay between).
- ``serve_health_agent_pods``: pods probed now.
- ``serve_health_agent_stream_connections_total``: Report streams an aggregator accepted.
- ``serve_health_agent_stream_failures_total``: streams that could not be opened, or ended.
- ``serve_health_agent_fallback_seconds``: how long the agent has been in fallback now (no
  aggregator accepted its stream for ``--fallback-after``: it writes for its own pods), 0 when
  it is not; computed at scrape time.
- ``serve_health_agent_fallback_writes_total{kind,result}``: fallback writes (``kind`` label,
  condition or event) by ``result``: success, error (each failed attempt), not_found (the pod is
  gone), dropped (no longer wanted when it would have gone: an aggregator came back, an
  override came, the probes changed their mind), conflict (the pod changed since the version
  the write was decided on: decided again).
- ``serve_health_agent_fallback_lease_renewed``: 1 while the aggregators' Lease is seen renewed
  by an agent without a stream (the gate holds its fallback back), else 0.
- ``serve_health_agent_fallback_api_slot_seconds``: seconds between two slots of the agent's
  share of the fleet's API budget (``--fallback-api-budget``).
- ``serve_health_agent_fallback_api_wait_seconds_total``: time fallback requests waited for a
  slot.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from node_agent.sink import MetricsSink
from node_agent.watchdog import Watchdog
from servehealth_common.config import split_host_port
from servehealth_common.listening import host_port, start_metrics
from servehealth_common.metrics_http import MetricsServer, MetricsServerSettings
from servehealth_common.states import OBSERVABLE_STATES, ServeState

log = logging.getLogger(__name__)

PREFIX = "serve_health_agent"
#: The states of the state set, in the proto's order, and their label values.
STATE_LABELS = tuple(
    (state, state.name.lower()) for state in ServeState if state in OBSERVABLE_STATES
)
#: Probe turns: a healthy proxy answers in milliseconds; a confirmed failure takes two probes
#: (up to --probe-timeout each) and --confirm-delay.
TURN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class _ProbedPod:
    namespace: str
    name: str
    state: ServeState | None = None  # None until its first turn ends


class _ProbedPods(Collector):
    """``serve_health_agent_probe_state`` and ``serve_health_agent_pods``, at scrape time."""

    def __init__(self, pods: dict[Hashable, _ProbedPod]) -> None:
        self._pods = pods

    def collect(self) -> Iterator[GaugeMetricFamily]:
        states = GaugeMetricFamily(
            f"{PREFIX}_probe_state",
            "The state of each pod this agent probes, as a state set: 1 for its latest "
            "probe's state, 0 for the others.",
            labels=["namespace", "pod", "state"],
        )
        for pod in self._pods.values():
            if pod.state is None:
                continue
            for state, label in STATE_LABELS:
                states.add_metric([pod.namespace, pod.name, label], 1 if state is pod.state else 0)
        yield states
        yield GaugeMetricFamily(
            f"{PREFIX}_pods", "Pods this agent probes now.", value=len(self._pods)
        )


class AgentMetrics(MetricsSink):
    """The agent's metrics, in :attr:`registry`; a :class:`~node_agent.sink.MetricsSink`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._pods: dict[Hashable, _ProbedPod] = {}
        r.register(_ProbedPods(self._pods))
        self._turns = Histogram(
            f"{PREFIX}_probe_duration_seconds",
            "Duration of probe turns of one pod (a confirmed failure counts both probes and "
            "the delay between).",
            buckets=TURN_BUCKETS,
            registry=r,
        )
        self._connected = Gauge(
            f"{PREFIX}_connected",
            "1 while a Report stream to an aggregator is open and accepted, else 0.",
            registry=r,
        )
        self._connections = Counter(
            f"{PREFIX}_stream_connections",
            "Report streams an aggregator accepted (the first connection and every reconnection).",
            registry=r,
        )
        self._failures = Counter(
            f"{PREFIX}_stream_failures",
            "Report streams that could not be opened (aggregator away, refused) or ended; each "
            "is retried.",
            registry=r,
        )
        self._fallback_seconds = Gauge(
            f"{PREFIX}_fallback_seconds",
            "How long this agent has been in fallback now (no aggregator accepted its stream for "
            "--fallback-after: it writes for its own pods itself); 0 when it is not.",
            registry=r,
        )
        self._fallback_writes = Counter(
            f"{PREFIX}_fallback_writes",
            "Fallback writes by kind (label, condition, event) and result (success; error: each "
            "failed attempt; not_found: the pod is gone; dropped: no longer wanted when it "
            "would have gone, e.g. an aggregator came back; conflict: the pod changed since the "
            "write was decided).",
            ["kind", "result"],
            registry=r,
        )
        self._lease_renewed = Gauge(
            f"{PREFIX}_fallback_lease_renewed",
            "1 while the aggregators' Lease is seen renewed by this agent without a stream (its "
            "fallback is held back), else 0.",
            registry=r,
        )
        self._slot_seconds = Gauge(
            f"{PREFIX}_fallback_api_slot_seconds",
            "Seconds between two slots of this agent's share of the fleet's API budget in "
            "fallback (--fallback-api-budget, the fleet size the aggregator announced).",
            registry=r,
        )
        self._waited = Counter(
            f"{PREFIX}_fallback_api_wait_seconds",
            "Time fallback requests waited for a slot of this agent's API budget.",
            registry=r,
        )

    # -- MetricsSink --------------------------------------------------------------------

    def probing(self, key: Hashable, namespace: str, name: str) -> None:
        self._pods[key] = _ProbedPod(namespace, name)

    def probed(self, key: Hashable, state: ServeState, seconds: float) -> None:
        pod = self._pods.get(key)
        if pod is not None:
            pod.state = state
        self._turns.observe(seconds)

    def not_probing(self, key: Hashable) -> None:
        self._pods.pop(key, None)

    def connected(self, up: bool) -> None:
        self._connected.set(1 if up else 0)
        if up:
            self._connections.inc()

    def stream_failed(self) -> None:
        self._failures.inc()

    def fallback_clock(self, seconds: Callable[[], float]) -> None:
        self._fallback_seconds.set_function(seconds)

    def fallback_write(self, kind: str, result: str) -> None:
        self._fallback_writes.labels(kind, result).inc()

    def fallback_gauges(
        self, lease_renewed: Callable[[], float], slot_seconds: Callable[[], float]
    ) -> None:
        self._lease_renewed.set_function(lease_renewed)
        self._slot_seconds.set_function(slot_seconds)

    def fallback_waited(self, seconds: float) -> None:
        self._waited.inc(seconds)


class Readiness(Protocol):
    """What ``/readyz`` asks the agent (:class:`~node_agent.agent.Agent`, or
    :class:`~node_agent.daemonset.NodeAgent`)."""

    def not_ready(self) -> str | None:
        """None once the agent knows what to probe, else why not (one line)."""


@contextlib.asynccontextmanager
async def serving(
    listen: str, metrics: AgentMetrics, agent: Readiness, watchdog: Watchdog | None
) -> AsyncIterator[MetricsServer]:
    """``/livez``, ``/readyz`` and ``/metrics`` on ``listen`` (``--metrics-listen``) for the
    ``async with`` block; :class:`~servehealth_common.listening.CannotListen` if it cannot be
    bound.

    ``/livez``: the server runs on the agent's event loop, so an answer at all means the loop
    runs, and the agent's loops run as long as the process does (one that ends ends it). With
    a watchdog, it also fails (503 and why) while the watchdog finds the agent stalled (its
    loop or its probes silent for ``--stall-timeout``), the moment before it ends the process.
    ``/readyz``: ``agent.not_ready()``, never the aggregator's reachability.
    """
    host, port = split_host_port(listen)
    server = MetricsServer(
        metrics.registry,
        MetricsServerSettings(host=host, port=port),
        checks={
            # Without a watchdog, answering at all means the event loop runs.
            "/livez": watchdog.stall if watchdog is not None else lambda: None,
            "/readyz": agent.not_ready,
        },
    )
    await start_metrics(server, "--metrics-listen")
    log.info("serving /livez, /readyz and /metrics on %s", host_port(*server.address))
    try:
        yield server
    finally:
        await server.stop()
