"""The sections of the aggregator's ``--help``: each title, and the first flag of its section
(the settings are declared in section order: :class:`aggregator.flags.AggregatorFlags`)."""

from __future__ import annotations

AGGREGATOR: tuple[tuple[str, str], ...] = (
    ("listening, TLS and authentication", "listen"),
    ("Kubernetes: which pods, and what is written to them", "kube_backend"),
    ("the Serve controller's view (pods with no proxy by design)", "ray_dashboard_port"),
    ("the Kubernetes API client", "kube_qps"),
    ("pod health: silence, resyncs, the label key, thresholds", "startup_grace"),
    ("report streams: acks and limits", "ack_every"),
    ("connections, expiry and shutdown", "handshake_timeout"),
    ("pulls: pods no agent speaks for", "pull_interval"),
    ("self-protection (PANIC)", "panic_threshold"),
    ("leader election (replicas)", "leader_elect"),
    ("logging", "log_level"),
)
