"""Facts read from a Pod object's JSON that both programs need."""

from __future__ import annotations

from typing import Any

#: KubeRay names the Serve proxy's container port "serve" (and Serve ports "serve-*").
SERVE_PORT_NAME = "serve"
#: The container port of the Serve gRPC proxy, where a pod declares one.
SERVE_GRPC_PORT_NAME = "serve-grpc"


def serve_port(pod: dict[str, Any], default: int) -> int:
    """The container port named ``serve``, else ``default``."""
    return named_port(pod, SERVE_PORT_NAME, default)


def named_port(pod: dict[str, Any], name: str, default: int) -> int:
    """The container port named ``name``, else ``default``."""
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def grpc_address(host: str, port: int) -> str:
    """``host:port`` for a gRPC target (IPv6 addresses in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def healthz_url(pod_ip: str, port: int) -> str:
    """``http://<pod IP>:<port>/-/healthz`` (IPv6 addresses in brackets)."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/-/healthz"
