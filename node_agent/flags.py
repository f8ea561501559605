"""Every knob of the node agent, in one frozen dataclass (flags and SERVE_HEALTH_* from it)."""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.token import DEFAULT_TOKEN_FILE
from servehealth_common import flags as shared
from servehealth_common.config import setting
from servehealth_common.tls import check_pair, check_readable

MODES = ("sidecar", "daemonset")


@dataclass(frozen=True)
class AgentFlags:
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
    interval: float = setting(1.0, "How often each proxy is probed.", duration=True)
    probe_timeout: float = setting(
        0.5, "Total time one probe (healthz and routes) may take.", duration=True
    )
    confirm_delay: float = setting(
        0.1, "After a first failure, re-probe this much later before reporting it.", duration=True
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
        "are back within the aggregator's startup grace after a restart or a failover.",
        duration=True,
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
        check_readable(self.tls_ca, "--tls-ca")
        check_pair(self.tls_cert, self.tls_key, "--tls-cert", "--tls-key")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("--tls-cert and --tls-key need --tls-ca (they are only used over TLS)")
        if not self.proxy_url.startswith(("http://", "https://")):
            raise ValueError(f"--proxy-url must be an http(s) URL, got {self.proxy_url!r}")
        if self.interval <= 0 or self.probe_timeout <= 0:
            raise ValueError("--interval and --probe-timeout must be positive")
        if self.token_file != DEFAULT_TOKEN_FILE:
            check_readable(self.token_file, "--token-file")
        if self.connect_timeout <= 0 or self.reconnect_max <= 0:
            raise ValueError("--connect-timeout and --reconnect-max must be positive")
        shared.check_shared(kube_timeout=self.kube_timeout, proxy_port=self.proxy_port)
        if self.probe_concurrency < 1:
            raise ValueError("--probe-concurrency must be at least 1")
        if self.confirm_delay < 0:
            raise ValueError("--confirm-delay must not be negative")
        if self.probe_timeout >= self.interval:
            raise ValueError(
                f"--probe-timeout ({self.probe_timeout:g}s) must be shorter than "
                f"--interval ({self.interval:g}s)"
            )

    @property
    def aggregators(self) -> tuple[str, ...]:
        """The addresses of ``--aggregator``, in the order they are tried."""
        return tuple(part.strip() for part in self.aggregator.split(",") if part.strip())
