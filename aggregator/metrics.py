"""Prometheus metrics of the aggregator, in a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from aggregator.decision.shadow import Disagreements
from servehealth_common.override import VALUES as OVERRIDE_VALUES
from servehealth_common.states import ServeState

PREFIX = "serve_health"


@dataclass(frozen=True, slots=True)
class _ScrapedGauge(Collector):
    """A gauge with one label, read at scrape time (no hot-path cost): ``values`` gives the
    count of each label value."""

    name: str
    documentation: str
    label: str
    values: Callable[[], Mapping[str, float]]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(f"{PREFIX}_{self.name}", self.documentation, labels=[self.label])
        for value, count in self.values().items():
            family.add_metric([value], count)
        yield family


class Metrics:
    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        Info(f"{PREFIX}_build", "Aggregator build information.", registry=self.registry).info(
            {"version": version}
        )
        self._declare_streams()
        self._declare_writes()
        self._declare_probes()
        self._declare_protection()
        self._declare_leadership()

    def _counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(f"{PREFIX}_{name}", documentation, labels, registry=self.registry)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(f"{PREFIX}_{name}", documentation, registry=self.registry)

    def _histogram(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(
            f"{PREFIX}_{name}", documentation, labels, buckets=buckets, registry=self.registry
        )

    def _declare_streams(self) -> None:
        """The report streams, token checks and inspection watchers."""
        self.reports = self._counter("reports", "Pod reports received from agents.")
        self.transitions = self._counter(
            "transitions", "Pod state transitions.", ["from_state", "to_state", "source"]
        )
        self.label_changes = self._counter(
            "label_changes", "Changes of the desired serve label, by new value.", ["value"]
        )
        self.reports_ignored = self._counter(
            "reports_ignored",
            "Reports skipped without ending their stream, by reason (unknown_pod: a DaemonSet "
            "agent reported a pod the aggregator does not track).",
            ["reason"],
        )
        self.streams_rejected = self._counter(
            "streams_rejected",
            "Report streams ended by the aggregator because of bad input, by gRPC status.",
            ["code"],
        )
        self.auth = self._counter(
            "auth",
            "Token checks of report streams and inspection calls (--auth, --inspection-auth), "
            "by service (report, inspection) and result (ok, unauthenticated, "
            "permission_denied, unavailable; expired: a stream ended as its token expired).",
            ["service", "result"],
        )
        self.token_reviews = self._counter(
            "token_reviews",
            "TokenReview API calls, by result (authenticated, rejected, error).",
            ["result"],
        )
        self.token_cache = self._counter(
            "token_cache",
            "Token checks answered from the cache of TokenReview answers (hit) or not (miss).",
            ["result"],
        )
        self.agents_connected = self._gauge(
            "agents_connected", "Open report streams that have said hello."
        )
        self.metrics_connections_refused = self._counter(
            "metrics_connections_refused",
            "Connections to the /metrics port closed at once because its connection cap "
            "(64) was reached.",
        )
        self.watchers = self._gauge("transition_watchers", "Open WatchTransitions streams.")

    def _declare_writes(self) -> None:
        """The Kubernetes side: writes, retries, denials, watches, Events, shadow mode, the
        serve view."""
        self.label_writes = self._counter(
            "label_writes",
            "Kubernetes writes of the serve label or readiness condition, by kind and result "
            "(success, error, not_found, conflict).",
            ["kind", "result"],
        )
        self.api_retries = self._counter(
            "api_retries",
            "Kubernetes API requests that will be retried, by HTTP status (or transport).",
            ["status"],
        )
        self.api_denied = self._counter(
            "api_denied",
            "Kubernetes API calls refused with 401 or 403 (RBAC, or a token not accepted), by "
            "verb and resource.",
            ["verb", "resource"],
        )
        self.watch_restarts = self._counter(
            "watch_restarts",
            "Pod watch restarts, by reason (ended, gone = 410 and re-list, error).",
            ["reason"],
        )
        self.events = self._counter(
            "events",
            "Kubernetes Events about label changes, by result (sent, error, dropped).",
            ["result"],
        )
        self.would_be_writes = self._counter(
            "would_be_writes",
            "Writes shadow mode (--dry-run) skipped, by kind (label, condition, event, lease).",
            ["kind"],
        )
        self.dry_run = self._gauge(
            "dry_run", "1 in shadow mode (--dry-run: nothing is written), else 0."
        )
        self.serve_view_polls = self._counter(
            "serve_view_polls",
            "GETs of a Ray head's /api/serve/applications/ (where Serve runs proxies), by "
            "result (ok, error: the cluster keeps its last view).",
            ["result"],
        )

    def _declare_probes(self) -> None:
        """The pull fallback's probes, the probe latency agents report, how long writes take,
        and what the kubelet and the agents did."""
        self.pull_probes = self._counter(
            "pull_probes",
            "Probes of pods made by the aggregator itself (pull fallback), by resulting state.",
            ["result"],
        )
        self.pull_latency = self._histogram(
            "pull_probe_seconds",
            "Latency of pull probes (a confirmed failure counts both probes).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.report_probe_latency = self._histogram(
            "report_probe_seconds",
            "Probe latency the agents report: their probe of the Serve proxy (HTTP, and gRPC "
            "with gRPC ingress; a confirmed failure counts both probes).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.write_delay = self._histogram(
            "write_delay_seconds",
            "From a decision to its label or condition write landing in the API (queue, rate "
            "limit and retries included; a newer value wanted before it landed extends the "
            "same write): the aggregator's share of detection latency.",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0),
        )
        for kind in ("label", "condition"):  # every series from the start, for dashboards
            self.write_delay.labels(kind)
        self.pods_kubelet_checks_serve = self._gauge(
            "pods_kubelet_checks_serve",
            "Pods whose readiness probe (the kubelet's) checks the Serve proxy too, as KubeRay's "
            "injected probe does: for them a Service routes only where both agree, so fail "
            "static and no proxy by design cannot hold (issue 27; docs/install.md).",
        )
        self.agent_fallback_pods = self._gauge(
            "agent_fallback_pods",
            "Pods that agents in fallback wrote (no aggregator answered them) since the previous "
            "leader's last Lease renewal, found when this replica took over (without "
            "--leader-elect, at start: the agents' marks still standing).",
        )

    def _declare_protection(self) -> None:
        """Self-protection: PANIC, the writes it holds, its looks and restores."""
        self.panic = self._gauge(
            "panic",
            "1 while the aggregator suspects itself and holds writes that remove pods.",
        )
        self.panic_held_writes = self._gauge(
            "panic_held_writes",
            "Writes that would take a pod out of service, held by PANIC now.",
        )
        self.panic_looks = self._counter(
            "panic_looks",
            "Looks at a sample of pods in service, after a suspect failure or before PANIC ends, "
            "by verdict (lone: few pods fail; mass: too many fail at once).",
            ["verdict"],
        )
        self.panic_restored = self._counter(
            "panic_restored",
            "Pods put back in service when PANIC began: a suspect failure had taken them out "
            "within one pull interval before it (the first signs of the mass failure).",
        )

    def _declare_leadership(self) -> None:
        """Leader election."""
        self.leader = self._gauge(
            "leader",
            "1 while this replica leads (accepts reports, writes to the API), 0 as a standby; "
            "always 1 without --leader-elect.",
        )
        self.leader_transitions = self._counter(
            "leader_transitions",
            "Changes of this replica's leadership, by change (acquired, lost).",
            ["change"],
        )
        self.lease_renew_failures = self._counter(
            "lease_renew_failures",
            "Attempts of the leader to renew its Lease that failed (API errors, timeouts, "
            "conflicts); leadership is lost after --leader-elect-renew-deadline of them.",
        )

    def track_pull_mode(self, pods: Callable[[], int]) -> None:
        self._gauge(
            "pods_in_pull_mode", "Pods no agent speaks for (probed by the aggregator)."
        ).set_function(pods)

    def track_pods(self, counts: Callable[[], dict[ServeState, int]]) -> None:
        """``serve_health_pods{state=...}``, read from the tracker at scrape time."""
        self._scraped(
            "pods",
            "Tracked pods by serve state.",
            "state",
            lambda: {state.name: count for state, count in counts().items()},
        )

    def track_disagreements(self, counts: Callable[[], Disagreements]) -> None:
        """``serve_health_shadow_disagreements{direction}``: pods carrying another value than
        the aggregator would write, ``in`` (would_enter) and ``out`` (would_leave)."""

        def by_direction() -> dict[str, float]:
            found = counts()
            return {"in": found.would_enter, "out": found.would_leave}

        self._scraped(
            "shadow_disagreements",
            "Pods that carry another value than the aggregator would write, by direction (in: "
            "it would put them in service; out: it would take them out). Any mode: drift.",
            "direction",
            by_direction,
        )

    def track_overrides(self, counts: Callable[[], dict[str, int]]) -> None:
        """``serve_health_overrides{value}``: pods whose override is honoured, by value."""

        def by_value() -> dict[str, float]:
            found = counts()
            return {value: found.get(value, 0) for value in OVERRIDE_VALUES}

        self._scraped(
            "overrides",
            "Pods whose ray-serve-health/override annotation is honoured, by value "
            "(out-of-service, in-service).",
            "value",
            by_value,
        )

    def _scraped(
        self, name: str, documentation: str, label: str, values: Callable[[], Mapping[str, float]]
    ) -> None:
        self.registry.register(_ScrapedGauge(name, documentation, label, values))

    def track_writer(self, pending: Callable[[], int]) -> None:
        self._gauge(
            "writes_pending",
            "Pods with a label or condition write waiting (queued, in flight or backing off).",
        ).set_function(pending)
