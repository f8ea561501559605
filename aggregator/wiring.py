"""The one place where the command line becomes components.

Every component takes its own small settings object (or a few plain values); this module alone
reads :class:`~aggregator.flags.AggregatorFlags` and decides which backend, guard, elector and
metrics server to build. :func:`build_aggregator` returns an :class:`~aggregator.server.Aggregator`
ready to ``start()``; call it inside the running event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from aggregator import __version__
from aggregator.auth import ReviewUnavailable, TokenReviewer
from aggregator.channel_options import GrpcServerSettings
from aggregator.decision.core import Core, CoreSettings
from aggregator.decision.resync import ResyncSettings
from aggregator.decision.self_protection import ProtectionSettings
from aggregator.decision.shadow import WOULD_BE_KINDS, ShadowView
from aggregator.decision.tracker import Clock, Tracker, TrackerSettings
from aggregator.fallback_settings import write_settings
from aggregator.flags import AggregatorFlags
from aggregator.guard import Guard
from aggregator.ingest.admission import AdmissionSettings
from aggregator.ingest.report_service import ReportService, ReportSettings
from aggregator.inspection_service import InspectionService
from aggregator.kube.api import KubeApi
from aggregator.kube.registry import KubeRegistry, KubeSettings
from aggregator.leader.elector import ElectionSettings
from aggregator.leader.label import LeaderLabel
from aggregator.leader.lease import (
    LeaderElectionConfigError,
    candidate_identity,
    lease_namespace,
    make_elector,
)
from aggregator.leader.own_pods import leader_label
from aggregator.lifecycle import Lifecycle, not_ready
from aggregator.metrics import Metrics
from aggregator.pull.expiry import ExpiryLoop
from aggregator.pull.puller import Puller, PullSettings
from aggregator.pull.serve_view_poller import ServeViewSettings
from aggregator.registry import MemoryRegistry, PodRegistry
from aggregator.server import Aggregator, Election, PortSettings
from servehealth_common.config import split_host_port
from servehealth_common.kube.client import NoKubeConfig, find_config, load_configuration
from servehealth_common.kube.errors import APIError
from servehealth_common.metrics_http import HealthCheck, MetricsServer, MetricsServerSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

#: Threads (and connections) for TokenReview calls: a pool of their own, so that a reconnect
#: storm of agents waits neither for nor in front of label writes.
REVIEW_THREADS = 8


S = TypeVar("S", bound="DataclassInstance")


# -- each component's own settings ------------------------------------------------------------


def from_flags(kind: type[S], flags: AggregatorFlags, **given: Any) -> S:
    """A ``kind`` settings object: each field named as a flag takes that flag's value, unless
    ``given`` has it; the others keep their defaults."""
    named = {field.name for field in fields(flags)} - given.keys()
    taken = {
        field.name: getattr(flags, field.name) for field in fields(kind) if field.name in named
    }
    return kind(**taken, **given)


def tracker_settings(flags: AggregatorFlags) -> TrackerSettings:
    # A pulled pod is pulled again every pull interval at the latest.
    return from_flags(TrackerSettings, flags, pull_ttl=flags.pull_interval + flags.heartbeat_ttl)


def core_settings(flags: AggregatorFlags) -> CoreSettings:
    return CoreSettings(
        protection=ProtectionSettings(
            threshold=flags.panic_threshold,
            min_pods=flags.panic_min_pods,
            # A mass failure that develops within one pull interval shows itself within two
            # (a pulled pod's failure is seen at its next pull, one timeout later): removals
            # that came that soon before PANIC were its first signs.
            restore_window=2 * flags.pull_interval + flags.pull_timeout,
        ),
        # Memory backend only: a pod silent this long is forgotten (no watch, no pulls).
        forget_silent_after=10 * flags.heartbeat_ttl,
        resync=ResyncSettings(base=flags.resync_interval),
    )


def report_settings(flags: AggregatorFlags) -> ReportSettings:
    return from_flags(
        ReportSettings,
        flags,
        # An agent that reports on change sends enough reports in a row to move a pod.
        reports_per_change=flags.success_threshold,
        reports_per_failure=flags.failure_threshold,
        admission=from_flags(AdmissionSettings, flags),
        writes=write_settings(flags),
    )


def port_settings(flags: AggregatorFlags) -> PortSettings:
    return from_flags(
        PortSettings,
        flags,
        startup_grace=flags.effective_startup_grace,
        grpc=from_flags(GrpcServerSettings, flags),
    )


def kube_settings(flags: AggregatorFlags) -> KubeSettings:
    return from_flags(
        KubeSettings,
        flags,
        namespaces=flags.namespace,
        qps=flags.kube_qps,
        burst=flags.kube_burst,
        concurrency=flags.kube_concurrency,
        serve_view=serve_view_settings(flags),
    )


def serve_view_settings(flags: AggregatorFlags) -> ServeViewSettings:
    return ServeViewSettings(
        dashboard_port=flags.ray_dashboard_port,
        interval=flags.serve_view_interval,
        # A slow dashboard must not hold the start (one round runs before reports are taken).
        timeout=min(2.0, flags.serve_view_interval),
        token_file=flags.ray_dashboard_token_file,
    )


# -- the components that depend on the environment -----------------------------------------


def make_registry(flags: AggregatorFlags, metrics: Metrics) -> PodRegistry:
    """The backend the flags ask for; ``auto`` picks kubernetes when a config is found."""
    backend = flags.kube_backend
    if backend == "auto":
        found = find_config(flags.kubeconfig)
        backend = "kubernetes" if found else "memory"
        log.info(
            "--kube-backend auto: %s",
            f"using kubernetes ({found})" if found else "no Kubernetes configuration, using memory",
        )
    if backend == "memory":
        return MemoryRegistry(
            flags.label_key,
            dry_run=flags.dry_run,
            would_write=lambda kind: metrics.would_be_writes.labels(kind).inc(),
        )
    api = KubeApi(
        load_configuration(flags.kubeconfig),
        timeout=flags.kube_timeout,
        concurrency=flags.kube_concurrency,
        on_denied=lambda verb, resource: metrics.api_denied.labels(verb, resource).inc(),
    )
    return KubeRegistry(api, kube_settings(flags), metrics)


def make_guard(flags: AggregatorFlags, metrics: Metrics, *, knows_nodes: bool) -> Guard | None:
    """The guard the flags ask for (None when neither --auth nor --inspection-auth checks
    tokens); NoKubeConfig when they do and no Kubernetes configuration is found."""
    if flags.auth == "none":
        log.warning(
            "--auth none: any client that reaches the gRPC port may report for any pod and "
            "move it in or out of service; use it only for local use, never in a cluster"
        )
    checked = [
        flag
        for flag, value in (("--auth", flags.auth), ("--inspection-auth", flags.inspection_auth))
        if value == "tokenreview"
    ]
    if not checked:
        return None
    try:
        configuration = load_configuration(flags.kubeconfig)
    except NoKubeConfig as error:
        raise NoKubeConfig(
            f"{' and '.join(f'{flag} tokenreview' for flag in checked)}: tokens are checked with "
            f"the Kubernetes TokenReview API, and {error}; for local use without Kubernetes, "
            f"pass {' '.join(f'{flag} none' for flag in checked)}"
        ) from None
    api = KubeApi(
        configuration,
        timeout=flags.kube_timeout,
        concurrency=REVIEW_THREADS,
        on_denied=lambda verb, resource: metrics.api_denied.labels(verb, resource).inc(),
    )

    async def review(token: str, audience: str) -> dict[str, Any]:
        try:
            return await api.review_token(token, audience)
        except APIError as error:
            raise ReviewUnavailable(
                f"the Kubernetes API could not check the token ({error}); retry"
            ) from None

    reviewer = TokenReviewer(
        review, flags.auth_audience, metrics, clock=asyncio.get_running_loop().time
    )
    return Guard(
        reviewer,
        metrics,
        knows_nodes=knows_nodes,
        node_agents=flags.auth_node_agent_service_account,
        close=api.close,
    )


def make_election(
    flags: AggregatorFlags,
    registry: PodRegistry,
    metrics: Metrics,
    environ: Mapping[str, str] = os.environ,
) -> Election | None:
    """The Lease elector ``--leader-elect*`` describe (None without --leader-elect)."""
    if not flags.leader_elect:
        return None
    if not registry.seeds_from_cluster:
        raise LeaderElectionConfigError(
            f"--leader-elect needs the kubernetes backend, not {registry.name} "
            "(with --kube-backend auto: no Kubernetes configuration was found)"
        )
    elector, store = make_elector(
        load_configuration(flags.kubeconfig),
        namespace=lease_namespace(flags.leader_elect_namespace, environ),
        lease_name=flags.leader_elect_lease_name,
        identity=candidate_identity(flags.leader_elect_identity, environ),
        timings=ElectionSettings(
            lease_duration=int(flags.leader_elect_lease_duration),
            renew_deadline=flags.leader_elect_renew_deadline,
            retry_period=flags.leader_elect_retry_period,
        ),
        on_renew_failure=metrics.lease_renew_failures.inc,
        on_denied=lambda verb, resource: metrics.api_denied.labels(verb, resource).inc(),
    )
    return Election(
        elector,
        store,
        f"lease {flags.leader_elect_lease_duration:g}s, renew deadline "
        f"{flags.leader_elect_renew_deadline:g}s, retry {flags.leader_elect_retry_period:g}s",
        leader_label(flags.leader_label, store.api, store.namespace, environ),
    )


def make_shadow(
    flags: AggregatorFlags, core: Core, registry: PodRegistry, metrics: Metrics
) -> ShadowView:
    """The disagreement figures (any mode: drift), their metrics, and shadow mode's notice."""
    shadow = ShadowView(
        flags.dry_run,
        lambda: (r.key for r in core.pods()),
        core.desired_label,
        registry.targets,  # overrides included
    )
    metrics.dry_run.set(1 if flags.dry_run else 0)
    for kind in WOULD_BE_KINDS:
        metrics.would_be_writes.labels(kind)  # 0 until counted, so dashboards see every kind
    metrics.track_disagreements(shadow.disagreements)
    metrics.track_overrides(registry.overrides)
    if flags.dry_run:
        log.warning(
            "--dry-run: SHADOW MODE. Every decision is made as usual, but nothing is written "
            "to the Kubernetes API (no label, condition, Event or Lease): pods keep what they "
            "carry; nor may its agents, even when no aggregator answers. "
            "serve_health_shadow_disagreements and GetSummary's would_enter and would_leave "
            "count the pods that carry another value than the one it would write; would-be "
            "writes are logged at debug level"
        )
    return shadow


def make_metrics_server(
    flags: AggregatorFlags, metrics: Metrics, lifecycle: Lifecycle, label: LeaderLabel | None
) -> MetricsServer | None:
    """/metrics, /livez and /readyz on --metrics-listen (None: turned off)."""
    if not flags.metrics_listen:
        return None
    host, port = split_host_port(flags.metrics_listen)
    checks: dict[str, HealthCheck] = {
        "/livez": lambda: None,  # answered at all: the event loop runs
        "/readyz": lambda: not_ready(lifecycle.phase, label is None or label.settled),
    }
    return MetricsServer(
        metrics.registry,
        MetricsServerSettings(host=host, port=port),
        metrics.metrics_connections_refused.inc,
        checks=checks,
    )


def build_aggregator(
    flags: AggregatorFlags,
    *,
    registry: PodRegistry | None = None,
    clock: Clock = time.monotonic,
) -> Aggregator:
    """Every component of one aggregator process, wired together (not started)."""
    metrics = Metrics(__version__)
    registry = registry or make_registry(flags, metrics)
    election = make_election(flags, registry, metrics)
    lifecycle = Lifecycle()
    puller = Puller(from_flags(PullSettings, flags), metrics, clock)
    core = Core(
        Tracker(tracker_settings(flags), clock),
        registry,
        metrics,
        puller,
        core_settings(flags),
    )
    guard = make_guard(flags, metrics, knows_nodes=registry.seeds_from_cluster)
    shadow = make_shadow(flags, core, registry, metrics)
    label = election.label if election is not None else None
    return Aggregator(
        port_settings(flags),
        lifecycle=lifecycle,
        core=core,
        registry=registry,
        metrics=metrics,
        puller=puller,
        expiry=ExpiryLoop(core.expire, flags.expiry_interval),
        reports=ReportService(
            core,
            metrics,
            report_settings(flags),
            phase=lambda: lifecycle.phase,
            guard=guard if flags.auth == "tokenreview" else None,
        ),
        inspection=InspectionService(
            core,
            flags.label_key,
            guard=guard if flags.inspection_auth == "tokenreview" else None,
            shadow=shadow,
            registry=registry,
        ),
        metrics_server=make_metrics_server(flags, metrics, lifecycle, label),
        guard=guard,
        election=election,
    )
