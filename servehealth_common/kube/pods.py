"""Facts read from a Pod object's JSON that both programs need."""

from __future__ import annotations

from typing import Any

#: KubeRay names the Serve proxy's container port "serve".
SERVE_PORT_NAME = "serve"


def serve_port(pod: dict[str, Any], default: int) -> int:
    """The container port named ``serve``, else ``default``."""
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == SERVE_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def healthz_url(pod_ip: str, port: int) -> str:
    """``http://<pod IP>:<port>/-/healthz`` (IPv6 addresses in brackets)."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/-/healthz"
