"""Every knob of the aggregator, in one frozen dataclass (flags and SERVE_HEALTH_* from it).

Only the wiring (:mod:`aggregator.wiring`) and the command line read this; each component gets
its own small settings object from the wiring.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

from aggregator import flag_sections
from aggregator.leader import flags as leader_flags
from servehealth_common import flags as shared
from servehealth_common.config import check_listen_address, setting
from servehealth_common.tls import (
    check_pair,
    check_pem_certificates,
    check_pem_key,
    check_readable,
)

#: Fields checked by :meth:`AggregatorFlags._check_numbers`, by the bound they must meet.
_POSITIVE = (
    "heartbeat_interval",
    "heartbeat_ttl",
    "resync_interval",
    "expiry_interval",
    "kube_qps",
    "pull_interval",
    "pull_timeout",
    "serve_view_interval",
)
_AT_LEAST_1MS = (
    "hello_timeout",
    "handshake_timeout",
    "keepalive_time",
    "keepalive_timeout",
    "max_connection_idle",
)
_AT_LEAST_ONE = (
    "failure_threshold",
    "success_threshold",
    "ack_every",
    "max_streams_per_peer",
    "max_pods_per_stream",
    "max_reports_per_second",
    "kube_burst",
    "kube_concurrency",
    "pull_concurrency",
    "panic_min_pods",
)
#: max_connections 0: no limit; startup_grace 0: twice the TTL.
_NOT_NEGATIVE = ("max_connections", "startup_grace", "shutdown_grace")


def _shown(value: float, *, duration: bool) -> str:
    """A value as the user wrote it: ``0s``, ``500ms``, ``-1s``; ``100`` for a count."""
    if not duration:
        return str(value) if isinstance(value, int) else f"{value:g}"
    return f"{value * 1000:g}ms" if 0 < abs(value) < 1 else f"{value:g}s"


@dataclass(frozen=True)
class AggregatorFlags:
    #: --help in sections (:mod:`aggregator.flag_sections`).
    HELP_GROUPS: ClassVar[tuple[tuple[str, str], ...]] = flag_sections.AGGREGATOR

    listen: str = setting(
        "0.0.0.0:50051",
        "HOST:PORT of the gRPC server (reports, inspection, grpc.health.v1, reflection); "
        "port 0 picks a free one.",
    )
    tls_cert: str = setting(
        "",
        "PEM certificate (chain) of the gRPC port; with --tls-key the port serves TLS only. "
        "Re-read when the file changes (rotation needs no restart).",
        shown="(plaintext)",
    )
    tls_key: str = setting(
        "", "PEM private key of --tls-cert (both or neither).", shown="(plaintext)"
    )
    tls_client_ca: str = setting(
        "",
        "PEM CA bundle: require a client certificate signed by it on the gRPC port (mutual "
        "TLS); needs --tls-cert and --tls-key.",
        shown="(no client certificates)",
    )
    auth: str = setting(
        "tokenreview",
        "How agents prove who they are. tokenreview: each Report stream carries the agent's "
        "projected ServiceAccount token (authorization: Bearer), checked with the Kubernetes "
        "TokenReview API; a sidecar may report only for its own pod, a DaemonSet agent only "
        "for pods on its node. none: any client may report for any pod (local use only; "
        "logged as a warning at start).",
        choices=("tokenreview", "none"),
    )
    auth_audience: str = setting(
        "ray-serve-health",
        "Audience the agents' tokens must be issued for (the serviceAccountToken audience of "
        "their projected volume).",
    )
    auth_node_agent_service_account: tuple[str, ...] = setting(
        ("ray-serve-health/ray-serve-health-agent",),
        "NAMESPACE/NAME of a ServiceAccount whose tokens may report as a DaemonSet agent, for "
        "the pods on the token's node; repeat the flag (or comma-separate the variable) for "
        "several. Any other token may report only for its own pod.",
    )
    inspection_auth: str = setting(
        "none",
        "none: the read-only InspectionService answers whoever reaches the port; tokenreview: "
        "it wants a bearer token that TokenReview accepts for --auth-audience, as agents do "
        "(grpc.health.v1 and reflection stay open).",
        choices=("none", "tokenreview"),
    )
    metrics_listen: str = setting(
        "0.0.0.0:9090",
        "HOST:PORT of the plaintext HTTP endpoint: Prometheus /metrics, and /livez and /readyz "
        "for the kubelet's probes; empty disables it (and the probes).",
    )
    kube_backend: str = setting(
        "auto",
        "Where pods and labels live. kubernetes: discover Ray pods and write their label; "
        "memory: pods register through their agent's hello and labels stay in the process "
        "(no cluster needed); auto: kubernetes when a configuration is found, else memory.",
        choices=("auto", "kubernetes", "memory"),
    )
    kubeconfig: str = shared.kubeconfig_flag()
    namespace: tuple[str, ...] = shared.namespace_flag()
    pod_selector: str = shared.pod_selector_flag()
    proxy_port: int = shared.proxy_port_flag()
    mode: str = setting(
        "label",
        "What the aggregator writes: label (the --label-key label), condition (a readiness-gate "
        "condition on pods/status, for pods that declare it in spec.readinessGates), or both.",
        choices=("label", "condition", "both"),
    )
    condition_type: str = setting(
        "ray.io/serve-proxy-healthy", "Pod condition type written in condition mode."
    )
    agent_fallback: str = setting(
        "auto",
        "Whether agents that no aggregator answered for their --fallback-after write for their "
        "own pods what it would (sent to them with the settings). auto: in condition and both "
        "modes (where a new pod is never Ready without a writer), not in label mode. Never "
        "with --dry-run: a shadow aggregator tells its agents not to write.",
        choices=("auto", "on", "off"),
    )
    events: bool = setting(
        True, "Record a Kubernetes Event on a pod whenever its serve label changes."
    )
    dry_run: bool = setting(
        False,
        "Shadow mode: decide everything as usual (discovery, agents, pulls, PANIC, inspection, "
        "metrics) but write nothing to the Kubernetes API: no label, condition, Event or Lease. "
        "serve_health_shadow_disagreements and GetSummary count the pods that carry another "
        "value than the one it would write; its agents are told not to write either when no "
        "aggregator answers (whatever --agent-fallback says). Not with --leader-elect (run one "
        "replica).",
    )
    ray_dashboard_port: int = setting(
        8265,
        "Port of the Ray dashboard on a cluster's head pod (ray.io/node-type=head) with no "
        "container port named 'dashboard'. Its /api/serve/applications/ says where Serve "
        "runs proxies: a worker that refuses probes where none is meant to run (HeadOnly, "
        "Disabled, EveryNode without a replica) is NO_PROXY_BY_DESIGN, not NO_PROXY. 0: never "
        "asked (every refusal is NO_PROXY).",
    )
    ray_dashboard_token_file: str = setting(
        "",
        "File holding the Ray dashboard's token (Ray's token authentication), read at each "
        "poll and sent as 'authorization: Bearer'; empty: no token.",
        shown="(none)",
    )
    serve_view_interval: float = setting(
        10.0,
        "How often each Ray cluster's dashboard is asked where Serve runs proxies (at once for "
        "a new head); a dashboard that fails keeps its last answer.",
        duration=True,
    )
    kube_qps: float = setting(
        20.0,
        "Sustained label and condition writes per second (client-side token bucket; up to "
        "--kube-concurrency more may be on their way; Events have their own 5/s).",
    )
    kube_burst: int = setting(40, "Kubernetes API writes allowed in a burst above --kube-qps.")
    kube_timeout: float = shared.kube_timeout_flag()
    kube_concurrency: int = setting(
        16, "Kubernetes API requests in flight at most (threads of the synchronous client)."
    )
    startup_grace: float = setting(
        0.0,
        "After a start, how long agents get to reconnect before any pod can go SILENT; "
        "0 means twice --heartbeat-ttl.",
        duration=True,
        shown="2 x heartbeat TTL",
    )
    heartbeat_ttl: float = setting(
        3.0,
        "How long a pod no open stream keeps alive may go unobserved before it is SILENT: "
        "after its agent's stream ended (agents 0.2.0 and later: time to reconnect; a pod "
        "the aggregator can probe is pulled at once instead), or after the last heartbeat of "
        "an older agent.",
        duration=True,
    )
    heartbeat_interval: float = setting(
        1.0,
        "How often agents older than 0.2.0 (which send heartbeats) are asked to report every "
        "pod. Newer agents report on change and resync every --resync-interval; their "
        "liveness is their connection's (--keepalive-time).",
        duration=True,
        hidden=True,  # for agents before 0.2.0 only: not on --help
    )
    resync_interval: float = setting(
        30.0,
        "How often agents that report on change send every pod anyway (anti-entropy), up to "
        "128 pods; one more interval per doubling of the fleet beyond (x8 at 10,000 pods). "
        "Three intervals without a report while its stream is open: SILENT.",
        duration=True,
    )
    label_key: str = setting(
        "ray.io/serve", "The pod label set to true (SERVING) or false (anything else)."
    )
    failure_threshold: int = setting(
        1,
        "Consecutive non-serving observations before a SERVING pod leaves service "
        "(agents already confirm every failure with a second probe).",
    )
    success_threshold: int = setting(
        2,
        "Consecutive SERVING observations before a pod that left service returns "
        "(hysteresis against flapping).",
    )
    ack_every: int = setting(
        10,
        "Acks are cumulative: one for every report that changes a pod's state, otherwise one "
        "every this many messages of a stream.",
    )
    max_message_bytes: int = setting(
        64 * 1024, "Largest gRPC message accepted; larger ones end the stream (RESOURCE_EXHAUSTED)."
    )
    max_streams_per_peer: int = setting(
        64,
        "Report streams one client address (without its port) may hold open; more are ended "
        "at once (RESOURCE_EXHAUSTED).",
    )
    max_pods_per_stream: int = setting(
        512,
        "Distinct pods one report stream may report for; the report naming one more ends the "
        "stream (RESOURCE_EXHAUSTED).",
    )
    max_reports_per_second: int = setting(
        50,
        "Report messages one stream may send per second (token bucket, burst = this rate; an "
        "agent sends about one a second); a faster stream is ended (RESOURCE_EXHAUSTED).",
    )
    hello_timeout: float = setting(
        10.0,
        "How long a new Report stream gets to send its hello (agents send it at once); a "
        "stream still silent then is ended (DEADLINE_EXCEEDED) and frees its place.",
        duration=True,
    )
    handshake_timeout: float = setting(
        10.0,
        "How long a new gRPC connection gets to finish its handshake (TCP, TLS, HTTP/2 "
        "preface and first SETTINGS); a slower or silent one is closed (gRPC's own default: "
        "120 s).",
        duration=True,
    )
    keepalive_time: float = setting(
        2.0,
        "Ping each gRPC connection quiet this long (HTTP/2 PING): how agents are known alive. "
        "Unanswered for --keepalive-timeout, the connection closes and its agent's pods are "
        "pulled (a frozen or cut-off agent: within the sum of both). ~30 us of CPU a ping.",
        duration=True,
    )
    keepalive_timeout: float = setting(
        1.0,
        "How long such a ping may go unanswered before its connection is closed.",
        duration=True,
    )
    max_connection_idle: float = setting(
        300.0,
        "Close a gRPC connection with no call in flight for this long (a graceful GOAWAY: a "
        "client reconnects on its next call; agents always have their stream open).",
        duration=True,
    )
    max_connections: int = setting(
        20_000,
        "gRPC connections open at once at most (an agent holds one); more are closed as they "
        "arrive. Each costs 13-17 KiB of memory, ~45 KiB with a Report stream: the default "
        "fits a 1 GiB memory limit. 0: no limit.",
    )
    expiry_interval: float = setting(
        0.25, "How often the aggregator looks for pods past the heartbeat TTL.", duration=True
    )
    shutdown_grace: float = setting(
        2.0,
        "On SIGTERM, how long in-flight inspection calls get to finish; report streams are "
        "closed at once with UNAVAILABLE so agents reconnect elsewhere.",
        duration=True,
    )
    pull_interval: float = setting(
        5.0, "How often pods that never had an agent are probed by the aggregator.", duration=True
    )
    pull_timeout: float = setting(
        0.5, "Total time one pull probe (healthz and routes) may take.", duration=True
    )
    pull_concurrency: int = setting(256, "Pull probes in flight at most.")
    panic_threshold: float = setting(
        0.5,
        "PANIC (hold every write that takes a pod out of service for a timeout or a silence) "
        "when this share of tracked pods is UNHEALTHY or SILENT, seen in the tracker or by a "
        "look at the pods in service; pods out for such failures never reach this share.",
    )
    panic_min_pods: int = setting(
        3, "PANIC needs at least this many UNHEALTHY or SILENT pods (small fleets)."
    )
    leader_elect: bool = leader_flags.ENABLED
    leader_elect_lease_duration: float = leader_flags.LEASE_DURATION
    leader_elect_renew_deadline: float = leader_flags.RENEW_DEADLINE
    leader_elect_retry_period: float = leader_flags.RETRY_PERIOD
    leader_elect_lease_name: str = leader_flags.LEASE_NAME
    leader_elect_namespace: str = leader_flags.NAMESPACE
    leader_elect_identity: str = leader_flags.IDENTITY
    leader_label: str = leader_flags.LABEL
    log_level: str = shared.log_level_flag()
    log_format: str = shared.log_format_flag()

    def __post_init__(self) -> None:
        check_listen_address(self.listen, "--listen")
        if self.metrics_listen:
            check_listen_address(self.metrics_listen, "--metrics-listen")
        self._check_tls()
        if not self.auth_audience:
            raise ValueError("--auth-audience must not be empty")
        for account in self.auth_node_agent_service_account:
            if not re.fullmatch(r"[^/]+/[^/]+", account):
                raise ValueError(
                    f"--auth-node-agent-service-account {account!r} is not NAMESPACE/NAME"
                )
        self._check_numbers()
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError(
                f"--heartbeat-ttl ({self.heartbeat_ttl:g}s) must be longer than "
                f"--heartbeat-interval ({self.heartbeat_interval:g}s), or every pod goes SILENT"
            )
        shared.check_shared(kube_timeout=self.kube_timeout, proxy_port=self.proxy_port)
        leader_flags.check(
            enabled=self.leader_elect,
            dry_run=self.dry_run,
            memory_backend=self.kube_backend == "memory",
            duration=self.leader_elect_lease_duration,
            deadline=self.leader_elect_renew_deadline,
            retry=self.leader_elect_retry_period,
            lease_name=self.leader_elect_lease_name,
            label=self.leader_label,
        )

    def _check_tls(self) -> None:
        check_pair(self.tls_cert, self.tls_key, "--tls-cert", "--tls-key")
        check_pem_certificates(self.tls_cert, "--tls-cert")
        check_pem_key(self.tls_cert, self.tls_key, "--tls-cert", "--tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        check_readable(self.tls_client_ca, "--tls-client-ca")
        check_pem_certificates(self.tls_client_ca, "--tls-client-ca")

    def _check_numbers(self) -> None:
        """Each number against its bound; the error names that one flag and its value."""
        self._require(_POSITIVE, "must be positive", lambda value: value > 0)
        self._require(_AT_LEAST_1MS, "must be at least 1ms", lambda value: value >= 0.001)
        self._require(_AT_LEAST_ONE, "must be at least 1", lambda value: value >= 1)
        self._require(_NOT_NEGATIVE, "must not be negative", lambda value: value >= 0)
        self._require(("max_message_bytes",), "must be at least 1024", lambda v: v >= 1024)
        self._require(("ray_dashboard_port",), "must be 0-65535", lambda v: 0 <= v < 65536)
        self._require(("panic_threshold",), "must be in (0, 1], 1: no PANIC", lambda v: 0 < v <= 1)

    def _require(self, names: tuple[str, ...], rule: str, holds: Callable[[float], bool]) -> None:
        durations = {field.name for field in fields(self) if field.metadata.get("duration")}
        for name in names:
            value = getattr(self, name)
            if not holds(value):
                shown = _shown(value, duration=name in durations)
                raise ValueError(f"--{name.replace('_', '-')} {rule} (got {shown})")

    @property
    def effective_startup_grace(self) -> float:
        return self.startup_grace or 2 * self.heartbeat_ttl
