"""The flags both programs share, declared once: Kubernetes access, pod discovery, logging.

Each function returns a fresh :func:`~servehealth_common.config.setting` for one field; the
aggregator's and the agent's flag dataclasses use them, so the default and the help text of a
shared flag cannot drift apart. :func:`check_shared` validates them.
"""

from __future__ import annotations

from typing import Any

from servehealth_common.config import setting
from servehealth_common.logs import FORMATS, LEVELS


def kubeconfig_flag() -> Any:
    return setting(
        "",
        "Path of a kubeconfig file; without it: $KUBECONFIG, ~/.kube/config, then the "
        "in-cluster ServiceAccount (the agent needs one only in DaemonSet mode).",
        shown="(search)",
    )


def kube_timeout_flag() -> Any:
    return setting(10.0, "Deadline of one Kubernetes API request.", duration=True)


def namespace_flag() -> Any:
    return setting(
        (),
        "Namespace of the Ray pods to track (the agent: in DaemonSet mode); repeat the flag "
        "(or comma-separate the variable) for several.",
        shown="(all namespaces)",
    )


def pod_selector_flag() -> Any:
    return setting(
        "ray.io/node-type",
        "Label selector of the Ray pods to track (default: every KubeRay pod); a DaemonSet "
        "agent lists only those on its node (spec.nodeName).",
    )


def proxy_port_flag() -> Any:
    return setting(8000, "Serve proxy port of pods with no container port named 'serve'.")


def log_level_flag() -> Any:
    return setting("info", "Log level.", choices=LEVELS)


def log_format_flag() -> Any:
    return setting(
        "text",
        "text: one line per record for people; json: one JSON object per line (time, level, "
        "logger, message, and structured fields such as a transition's pod, old, new, source, "
        "reason, label) for log pipelines.",
        choices=FORMATS,
    )


def check_shared(*, kube_timeout: float, proxy_port: int) -> None:
    """Validate the shared flags; ValueError naming the flag."""
    if kube_timeout <= 0:
        raise ValueError("--kube-timeout must be positive")
    if not 0 < proxy_port < 65536:
        raise ValueError(f"--proxy-port must be a TCP port, got {proxy_port}")
