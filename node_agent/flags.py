"""Every knob of the node agent, in one frozen dataclass (flags and SERVE_HEALTH_* from it)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from node_agent.fallback.budget import DEFAULT_FLEET_BUDGET, DEFAULT_FLEET_SIZE
from node_agent.fallback.lease_gate import LeaseName
from node_agent.fallback.rules import FALLBACK_WRITES, WriteRules, refusal, rules_from_flags
from node_agent.token import DEFAULT_TOKEN_FILE
from servehealth_common import flags as shared
from servehealth_common.config import check_listen_address, setting
from servehealth_common.http import InvalidURL, parse_url
from servehealth_common.kube.pods import grpc_address
from servehealth_common.tls import check_pair, check_readable

MODES = ("sidecar", "daemonset")
#: A host name or IPv4 address of an --aggregator address (an IPv6 address goes in brackets).
_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?")
_PORT = re.compile(r"[0-9]{1,5}")


def check_address(address: str) -> None:
    """Raise ValueError unless ``address`` is HOST:PORT with a port 1-65535 (``[::1]:50051``
    for an IPv6 address): what was accepted before and failed only at every connection."""
    host, _, port = address.rpartition(":")
    try:
        if not (_PORT.fullmatch(port) and 1 <= int(port) <= 65535):
            raise ValueError(port)
        if host.startswith("[") and host.endswith("]"):
            ipaddress.IPv6Address(host[1:-1])  # ValueError unless an IPv6 address
        elif not _HOST.fullmatch(host):
            raise ValueError(host)
    except ValueError:
        raise ValueError(
            f"--aggregator: {address[:100]!r} is not HOST:PORT (a port 1-65535; an IPv6 "
            "address in brackets, as [::1]:50051)"
        ) from None


def check_proxy_url(url: str) -> None:
    """Raise ValueError unless ``url`` is a whole http(s) URL with a host and a port 1-65535
    (a URL the probe could never use would otherwise be reported UNHEALTHY for ever)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--proxy-url must be an http(s) URL, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError unless a number 0-65535
    except ValueError as error:
        raise ValueError(f"--proxy-url {url!r} is not a valid URL: {error}") from None
    if not parts.hostname:
        raise ValueError(f"--proxy-url {url!r} has no host")
    if port == 0:
        raise ValueError(f"--proxy-url {url!r}: the port must be 1-65535")
    try:
        parse_url(url)  # what the probe's HTTP client will make of it (IDNA, request target)
    except InvalidURL as error:
        raise ValueError(f"--proxy-url is not a valid URL: {error}") from None


@dataclass(frozen=True)
class AgentFlags:
    #: --help in sections: each title, and the first field of its section (in field order).
    HELP_GROUPS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("the aggregator, TLS and the token", "aggregator"),
        ("probing the Serve proxy", "proxy_url"),
        ("DaemonSet mode: the pods of this node", "mode"),
        ("reconnection", "connect_timeout"),
        ("fallback: when no aggregator answers", "fallback_after"),
        ("metrics and logging", "metrics_listen"),
    )

    aggregator: str = setting(
        "",
        "HOST:PORT of the aggregator's gRPC server (required): in Kubernetes its Service. "
        "Several comma-separated addresses (aggregator replicas with no Service in front) are "
        "tried in turn: a stream that ends moves on to the next one at once.",
        shown="(required)",
    )
    tls_ca: str = setting(
        "",
        "PEM CA bundle to verify the aggregator's certificate with; enables TLS. Files are "
        "re-read at every reconnection (rotation needs no restart).",
        shown="(plaintext)",
    )
    tls_cert: str = setting(
        "",
        "PEM client certificate (chain) presented to an aggregator that requires mutual TLS; "
        "needs --tls-key and --tls-ca.",
        shown="(none)",
    )
    tls_key: str = setting("", "PEM private key of --tls-cert (both or neither).", shown="(none)")
    token_file: str = setting(
        DEFAULT_TOKEN_FILE,
        "The agent's projected ServiceAccount token (audience ray-serve-health), read for "
        "every new stream (the kubelet rotates it) and sent as 'authorization: Bearer'. "
        "Without this default file the agent sends no token (for --auth none); a path given "
        "explicitly must exist; empty: never send one.",
    )
    proxy_url: str = setting(
        "http://127.0.0.1:8000/-/healthz",
        "The Serve proxy's health URL; /-/routes on the same host confirms a healthy answer.",
    )
    grpc_proxy_port: int = setting(
        0,
        "Port of the Serve gRPC proxy (gRPC ingress: Serve's grpc_options.port, 9000 by "
        "default) on the host of --proxy-url. The agent then also calls its Healthz, and the "
        "pod is SERVING only when both proxies serve. DaemonSet mode: for pods with no "
        "container port named 'serve-grpc'. 0: no gRPC ingress.",
    )
    interval: float = setting(
        0.75,
        "How often each proxy is probed: at least one probe starts every interval (start to "
        "start, jittered only shorter). A hang is known within interval + --probe-timeout; "
        "750ms + 500ms leaves the aggregator's decision and label write room within 1.5s "
        "(1s + 500ms would leave none).",
        duration=True,
    )
    probe_timeout: float = setting(
        0.5,
        "Total time one probe (healthz and routes) may take; shorter than --interval.",
        duration=True,
    )
    confirm_delay: float = setting(
        0.1, "After a first failure, re-probe this much later before reporting it.", duration=True
    )
    stall_timeout: float = setting(
        3.0,
        "The agent's watchdog: if its event loop does not run, or no probe finishes, for this "
        "long while the process lives, it exits (status 70), so that the aggregator sees it "
        "gone and probes its pods (its gRPC core would still answer the aggregator's pings). "
        "At least one probe turn (--interval + 2 x --probe-timeout + --confirm-delay) plus 1s; "
        "0: no watchdog.",
        duration=True,
    )
    mode: str = setting(
        "sidecar",
        "sidecar: probe --proxy-url and report for the pod named by POD_NAMESPACE/POD_NAME; "
        "daemonset: probe every Ray pod on the node NODE_NAME (pod IP, container port 'serve') "
        "and report for all of them on one stream.",
        choices=MODES,
    )
    kubeconfig: str = shared.kubeconfig_flag()
    namespace: tuple[str, ...] = shared.namespace_flag()
    pod_selector: str = shared.pod_selector_flag()
    proxy_port: int = shared.proxy_port_flag()
    probe_concurrency: int = setting(
        32, "Probes in flight at most (DaemonSet mode: across all pods of the node)."
    )
    kube_timeout: float = shared.kube_timeout_flag()
    connect_timeout: float = setting(
        5.0, "Deadline to connect to the aggregator and to hear its settings.", duration=True
    )
    reconnect_max: float = setting(
        2.0,
        "Longest wait between reconnection attempts (exponential from 200ms, jittered; with "
        "several --aggregator addresses, between rounds of all of them). Short, so that agents "
        "are back within the aggregator's startup grace after a restart or a failover. A hello "
        "the aggregator refuses as invalid is a permanent error: retried from 10s up to 5m.",
        duration=True,
    )
    fallback_after: float = setting(
        10.0,
        "When no aggregator has accepted this agent's stream for this long (since the last "
        "stream ended, or since the agent started), the agent writes for its own pods only (a "
        "sidecar its pod, a DaemonSet agent the pods on its node) what the aggregator would: "
        "the same label or condition, thresholds and fail static; it stops as soon as a "
        "stream is accepted. With leader election it also waits until no aggregator renews the "
        "Lease (--fallback-lease), so a failover (a standby leads ~9s after a crash, agents "
        "reconnect within --reconnect-max, 2s) never triggers it. 0: never.",
        duration=True,
    )
    fallback_write: str = setting(
        "",
        "What to write in fallback until an aggregator says (the last aggregator's settings win "
        "once received, kept across reconnections): label (--fallback-label-key), condition "
        "(--fallback-condition-type, on pods that declare it in spec.readinessGates) or both, "
        "with the aggregator's default thresholds (1 failure out, 2 successes in). Empty: only "
        "what the last aggregator's settings allow (its --agent-fallback).",
        choices=FALLBACK_WRITES,
        shown="(the aggregator's)",
    )
    fallback_label_key: str = setting(
        "ray.io/serve", "The label --fallback-write label (or both) writes: true or false."
    )
    fallback_condition_type: str = setting(
        "ray.io/serve-proxy-healthy",
        "The readiness-gate condition --fallback-write condition (or both) writes on pods/status.",
    )
    fallback_lease: str = setting(
        "",
        "NAMESPACE/NAME of the aggregators' leader-election Lease: while it is renewed (an "
        "aggregator leads, whether or not it accepts this agent), the agent does not fall "
        "back, and a fallback under way stops at once. Read (get and watch on that one Lease) "
        "only while no stream is up. The last aggregator's settings win once received. Empty: "
        "no gate (aggregators without --leader-elect).",
        shown="(the aggregator's)",
    )
    fallback_api_budget: float = setting(
        DEFAULT_FLEET_BUDGET,
        "Requests per second to the API server that the whole fleet of agents may send in "
        "fallback (reads of the Lease and of pods, writes, Events). Each agent spends its share "
        "(this divided by the fleet size the aggregator announced) in slots spread at random, "
        "and an agent with nothing to write sends nothing: a fleet losing its aggregator at "
        "once stays within it. The cost is latency in a large fleet: an agent's requests wait "
        "for its slot, every 2 x fleet size / budget seconds (11,000 agents at 40/s: 550s).",
    )
    fallback_fleet_size: int = setting(
        DEFAULT_FLEET_SIZE,
        "The fleet size assumed until an aggregator announces one (an agent that started during "
        "an outage).",
    )
    metrics_listen: str = setting(
        "",
        "HOST:PORT of the agent's plaintext HTTP endpoint: /livez (its loops run and its "
        "watchdog sees no stall), /readyz (it knows what to probe; never the aggregator's "
        "reachability) and Prometheus /metrics (serve_health_agent_*); port 0 picks a free one "
        "(logged). Empty: no port at all.",
        shown="(off)",
    )
    log_level: str = shared.log_level_flag()
    log_format: str = shared.log_format_flag()

    def __post_init__(self) -> None:
        if not self.aggregator:
            raise ValueError("--aggregator (or SERVE_HEALTH_AGGREGATOR) is required: HOST:PORT")
        if len(self.aggregators) != self.aggregator.count(",") + 1:
            raise ValueError(
                f"--aggregator {self.aggregator!r} has an empty address: HOST:PORT[,HOST:PORT...]"
            )
        for address in self.aggregators:
            check_address(address)
        check_readable(self.tls_ca, "--tls-ca")
        check_pair(self.tls_cert, self.tls_key, "--tls-cert", "--tls-key")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("--tls-cert and --tls-key need --tls-ca (they are only used over TLS)")
        check_proxy_url(self.proxy_url)
        if self.metrics_listen:
            check_listen_address(self.metrics_listen, "--metrics-listen")
        if self.interval <= 0 or self.probe_timeout <= 0:
            raise ValueError("--interval and --probe-timeout must be positive")
        if self.token_file != DEFAULT_TOKEN_FILE:
            check_readable(self.token_file, "--token-file")
        if self.connect_timeout <= 0 or self.reconnect_max <= 0:
            raise ValueError("--connect-timeout and --reconnect-max must be positive")
        shared.check_shared(kube_timeout=self.kube_timeout, proxy_port=self.proxy_port)
        if not 0 <= self.grpc_proxy_port <= 65535:
            raise ValueError(
                f"--grpc-proxy-port must be a port 1-65535, or 0 for none: {self.grpc_proxy_port}"
            )
        if self.probe_concurrency < 1:
            raise ValueError("--probe-concurrency must be at least 1")
        if self.confirm_delay < 0:
            raise ValueError("--confirm-delay must not be negative")
        if self.stall_timeout < 0:
            raise ValueError("--stall-timeout must not be negative")
        if self.fallback_after < 0:
            raise ValueError("--fallback-after must not be negative (0: no fallback)")
        LeaseName.parse(self.fallback_lease)  # raises ValueError: not namespace/name
        if self.fallback_api_budget <= 0 or self.fallback_fleet_size < 1:
            raise ValueError(
                "--fallback-api-budget must be positive and --fallback-fleet-size at least 1"
            )
        rules = self.fallback_rules
        if rules is not None and (why := refusal(rules)) is not None:
            raise ValueError(f"--fallback-write {self.fallback_write}: {why}")
        if self.probe_timeout >= self.interval:
            raise ValueError(
                f"--probe-timeout ({self.probe_timeout:g}s) must be shorter than "
                f"--interval ({self.interval:g}s)"
            )

    @property
    def effective_stall_timeout(self) -> float:
        """--stall-timeout, but never within a probe turn (plus a second) of a slow schedule."""
        if not self.stall_timeout:
            return 0.0
        longest_turn = self.interval + 2 * self.probe_timeout + self.confirm_delay
        return max(self.stall_timeout, longest_turn + 1.0)

    @property
    def fallback_rules(self) -> WriteRules | None:
        """What --fallback-write asks for (None: only what an aggregator's settings allow)."""
        return rules_from_flags(
            self.fallback_write, self.fallback_label_key, self.fallback_condition_type
        )

    @property
    def grpc_proxy_address(self) -> str | None:
        """``host:port`` of the sidecar's gRPC proxy (the host of --proxy-url), or None."""
        if not self.grpc_proxy_port:
            return None
        host = urlsplit(self.proxy_url).hostname or ""
        return grpc_address(host, self.grpc_proxy_port)

    @property
    def aggregators(self) -> tuple[str, ...]:
        """The addresses of ``--aggregator``, in the order they are tried."""
        return tuple(part.strip() for part in self.aggregator.split(",") if part.strip())
