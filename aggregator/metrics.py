"""Prometheus metrics of the aggregator, in a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from aggregator.decision.override import VALUES as OVERRIDE_VALUES
from aggregator.decision.shadow import Disagreements
from servehealth_common.states import ServeState

PREFIX = "serve_health"


class _PodsByState(Collector):
    """``serve_health_pods{state=...}``, read from the tracker at scrape time (no hot-path cost)."""

    def __init__(self, counts: Callable[[], dict[ServeState, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            f"{PREFIX}_pods", "Tracked pods by serve state.", labels=["state"]
        )
        for state, count in self._counts().items():
            family.add_metric([state.name], count)
        yield family


class _Disagreements(Collector):
    """``serve_health_shadow_disagreements{direction}``, counted at scrape time."""

    def __init__(self, counts: Callable[[], Disagreements]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            f"{PREFIX}_shadow_disagreements",
            "Pods that carry another value than the aggregator would write, by direction (in: "
            "it would put them in service; out: it would take them out). Any mode: drift.",
            labels=["direction"],
        )
        counts = self._counts()
        family.add_metric(["in"], counts.would_enter)
        family.add_metric(["out"], counts.would_leave)
        yield family


class _Overrides(Collector):
    """``serve_health_overrides{value}``, counted at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            f"{PREFIX}_overrides",
            "Pods whose ray-serve-health/override annotation is honoured, by value "
            "(out-of-service, in-service).",
            labels=["value"],
        )
        counts = self._counts()
        for value in OVERRIDE_VALUES:
            family.add_metric([value], counts.get(value, 0))
        yield family


class Metrics:
    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Info(f"{PREFIX}_build", "Aggregator build information.", registry=r).info(
            {"version": version}
        )
        self._declare_streams(r)
        self._declare_writes(r)
        self._declare_probes(r)
        self._declare_protection(r)
        self._declare_leadership(r)

    def _declare_streams(self, r: CollectorRegistry) -> None:
        """The report streams, token checks and inspection watchers."""
        self.reports = Counter(f"{PREFIX}_reports", "Pod reports received from agents.", registry=r)
        self.transitions = Counter(
            f"{PREFIX}_transitions",
            "Pod state transitions.",
            ["from_state", "to_state", "source"],
            registry=r,
        )
        self.label_changes = Counter(
            f"{PREFIX}_label_changes",
            "Changes of the desired serve label, by new value.",
            ["value"],
            registry=r,
        )
        self.reports_ignored = Counter(
            f"{PREFIX}_reports_ignored",
            "Reports skipped without ending their stream, by reason (unknown_pod: a DaemonSet "
            "agent reported a pod the aggregator does not track).",
            ["reason"],
            registry=r,
        )
        self.streams_rejected = Counter(
            f"{PREFIX}_streams_rejected",
            "Report streams ended by the aggregator because of bad input, by gRPC status.",
            ["code"],
            registry=r,
        )
        self.auth = Counter(
            f"{PREFIX}_auth",
            "Token checks of report streams and inspection calls (--auth, --inspection-auth), "
            "by service (report, inspection) and result (ok, unauthenticated, "
            "permission_denied, unavailable; expired: a stream ended as its token expired).",
            ["service", "result"],
            registry=r,
        )
        self.token_reviews = Counter(
            f"{PREFIX}_token_reviews",
            "TokenReview API calls, by result (authenticated, rejected, error).",
            ["result"],
            registry=r,
        )
        self.token_cache = Counter(
            f"{PREFIX}_token_cache",
            "Token checks answered from the cache of TokenReview answers (hit) or not (miss).",
            ["result"],
            registry=r,
        )
        self.agents_connected = Gauge(
            f"{PREFIX}_agents_connected", "Open report streams that have said hello.", registry=r
        )
        self.metrics_connections_refused = Counter(
            f"{PREFIX}_metrics_connections_refused",
            "Connections to the /metrics port closed at once because its connection cap "
            "(64) was reached.",
            registry=r,
        )
        self.watchers = Gauge(
            f"{PREFIX}_transition_watchers", "Open WatchTransitions streams.", registry=r
        )

    def _declare_writes(self, r: CollectorRegistry) -> None:
        """The Kubernetes side: writes, retries, denials, watches, Events, shadow mode, the
        serve view."""
        self.label_writes = Counter(
            f"{PREFIX}_label_writes",
            "Kubernetes writes of the serve label or readiness condition, by kind and result "
            "(success, error, not_found, conflict).",
            ["kind", "result"],
            registry=r,
        )
        self.api_retries = Counter(
            f"{PREFIX}_api_retries",
            "Kubernetes API requests that will be retried, by HTTP status (or transport).",
            ["status"],
            registry=r,
        )
        self.api_denied = Counter(
            f"{PREFIX}_api_denied",
            "Kubernetes API calls refused with 401 or 403 (RBAC, or a token not accepted), by "
            "verb and resource.",
            ["verb", "resource"],
            registry=r,
        )
        self.watch_restarts = Counter(
            f"{PREFIX}_watch_restarts",
            "Pod watch restarts, by reason (ended, gone = 410 and re-list, error).",
            ["reason"],
            registry=r,
        )
        self.events = Counter(
            f"{PREFIX}_events",
            "Kubernetes Events about label changes, by result (sent, error, dropped).",
            ["result"],
            registry=r,
        )
        self.would_be_writes = Counter(
            f"{PREFIX}_would_be_writes",
            "Writes shadow mode (--dry-run) skipped, by kind (label, condition, event, lease).",
            ["kind"],
            registry=r,
        )
        self.dry_run = Gauge(
            f"{PREFIX}_dry_run",
            "1 in shadow mode (--dry-run: nothing is written), else 0.",
            registry=r,
        )
        self.serve_view_polls = Counter(
            f"{PREFIX}_serve_view_polls",
            "GETs of a Ray head's /api/serve/applications/ (where Serve runs proxies), by "
            "result (ok, error: the cluster keeps its last view).",
            ["result"],
            registry=r,
        )

    def _declare_probes(self, r: CollectorRegistry) -> None:
        """The pull fallback's probes, the probe latency agents report, how long writes take,
        and what the kubelet and the agents did."""
        self.pull_probes = Counter(
            f"{PREFIX}_pull_probes",
            "Probes of pods made by the aggregator itself (pull fallback), by resulting state.",
            ["result"],
            registry=r,
        )
        self.pull_latency = Histogram(
            f"{PREFIX}_pull_probe_seconds",
            "Latency of pull probes (a confirmed failure counts both probes).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.report_probe_latency = Histogram(
            f"{PREFIX}_report_probe_seconds",
            "Probe latency the agents report: their probe of the Serve proxy (HTTP, and gRPC "
            "with gRPC ingress; a confirmed failure counts both probes).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.write_delay = Histogram(
            f"{PREFIX}_write_delay_seconds",
            "From a decision to its label or condition write landing in the API (queue, rate "
            "limit and retries included; a newer value wanted before it landed extends the "
            "same write): the aggregator's share of detection latency.",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0),
            registry=r,
        )
        for kind in ("label", "condition"):  # every series from the start, for dashboards
            self.write_delay.labels(kind)
        self.pods_kubelet_checks_serve = Gauge(
            f"{PREFIX}_pods_kubelet_checks_serve",
            "Pods whose readiness probe (the kubelet's) checks the Serve proxy too, as KubeRay's "
            "injected probe does: for them a Service routes only where both agree, so fail "
            "static and no proxy by design cannot hold (issue 27; docs/install.md).",
            registry=r,
        )
        self.agent_fallback_pods = Gauge(
            f"{PREFIX}_agent_fallback_pods",
            "Pods that agents in fallback wrote (no aggregator answered them) since the previous "
            "leader's last Lease renewal, found when this replica took over (without "
            "--leader-elect, at start: the agents' marks still standing).",
            registry=r,
        )

    def _declare_protection(self, r: CollectorRegistry) -> None:
        """Self-protection: PANIC, the writes it holds, its looks and restores."""
        self.panic = Gauge(
            f"{PREFIX}_panic",
            "1 while the aggregator suspects itself and holds writes that remove pods.",
            registry=r,
        )
        self.panic_held_writes = Gauge(
            f"{PREFIX}_panic_held_writes",
            "Writes that would take a pod out of service, held by PANIC now.",
            registry=r,
        )
        self.panic_looks = Counter(
            f"{PREFIX}_panic_looks",
            "Looks at a sample of pods in service, after a suspect failure or before PANIC ends, "
            "by verdict (lone: few pods fail; mass: too many fail at once).",
            ["verdict"],
            registry=r,
        )
        self.panic_restored = Counter(
            f"{PREFIX}_panic_restored",
            "Pods put back in service when PANIC began: a suspect failure had taken them out "
            "within one pull interval before it (the first signs of the mass failure).",
            registry=r,
        )

    def _declare_leadership(self, r: CollectorRegistry) -> None:
        """Leader election."""
        self.leader = Gauge(
            f"{PREFIX}_leader",
            "1 while this replica leads (accepts reports, writes to the API), 0 as a standby; "
            "always 1 without --leader-elect.",
            registry=r,
        )
        self.leader_transitions = Counter(
            f"{PREFIX}_leader_transitions",
            "Changes of this replica's leadership, by change (acquired, lost).",
            ["change"],
            registry=r,
        )
        self.lease_renew_failures = Counter(
            f"{PREFIX}_lease_renew_failures",
            "Attempts of the leader to renew its Lease that failed (API errors, timeouts, "
            "conflicts); leadership is lost after --leader-elect-renew-deadline of them.",
            registry=r,
        )

    def track_pull_mode(self, pods: Callable[[], int]) -> None:
        Gauge(
            f"{PREFIX}_pods_in_pull_mode",
            "Pods no agent speaks for (probed by the aggregator).",
            registry=self.registry,
        ).set_function(pods)

    def track_pods(self, counts: Callable[[], dict[ServeState, int]]) -> None:
        self.registry.register(_PodsByState(counts))

    def track_disagreements(self, counts: Callable[[], Disagreements]) -> None:
        """``serve_health_shadow_disagreements{direction}``: pods carrying another value than
        the aggregator would write, ``in`` (would_enter) and ``out`` (would_leave)."""
        self.registry.register(_Disagreements(counts))

    def track_overrides(self, counts: Callable[[], dict[str, int]]) -> None:
        """``serve_health_overrides{value}``: pods whose override is honoured, by value."""
        self.registry.register(_Overrides(counts))

    def track_writer(self, pending: Callable[[], int]) -> None:
        gauge = Gauge(
            f"{PREFIX}_writes_pending",
            "Pods with a label or condition write waiting (queued, in flight or backing off).",
            registry=self.registry,
        )
        gauge.set_function(pending)
