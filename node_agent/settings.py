"""Every knob of the node agent, in one frozen dataclass (flags and SERVE_HEALTH_* from it)."""

from __future__ import annotations

from dataclasses import dataclass

from servehealth_common.config import setting


@dataclass(frozen=True)
class Settings:
    aggregator: str = setting(
        "", "HOST:PORT of the aggregator's gRPC server (required).", shown="(required)"
    )
    proxy_url: str = setting(
        "http://127.0.0.1:8000/-/healthz",
        "The Serve proxy's health URL; /-/routes on the same host confirms a healthy answer.",
    )
    interval: float = setting(1.0, "How often the proxy is probed.", duration=True)
    probe_timeout: float = setting(
        0.5, "Total time one probe (healthz and routes) may take.", duration=True
    )
    confirm_delay: float = setting(
        0.1, "After a first failure, re-probe this much later before reporting it.", duration=True
    )
    mode: str = setting(
        "sidecar",
        "sidecar: report for the pod named by POD_NAMESPACE/POD_NAME.",
        choices=("sidecar",),
    )
    connect_timeout: float = setting(
        5.0, "Deadline to connect to the aggregator and to hear its settings.", duration=True
    )
    reconnect_max: float = setting(
        10.0, "Longest wait between reconnection attempts (exponential, jittered).", duration=True
    )
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if not self.aggregator:
            raise ValueError("--aggregator (or SERVE_HEALTH_AGGREGATOR) is required: HOST:PORT")
        if not self.proxy_url.startswith(("http://", "https://")):
            raise ValueError(f"--proxy-url must be an http(s) URL, got {self.proxy_url!r}")
        if self.interval <= 0 or self.probe_timeout <= 0:
            raise ValueError("--interval and --probe-timeout must be positive")
        if self.connect_timeout <= 0 or self.reconnect_max <= 0:
            raise ValueError("--connect-timeout and --reconnect-max must be positive")
        if self.confirm_delay < 0:
            raise ValueError("--confirm-delay must not be negative")
        if self.probe_timeout >= self.interval:
            raise ValueError(
                f"--probe-timeout ({self.probe_timeout:g}s) must be shorter than "
                f"--interval ({self.interval:g}s)"
            )
