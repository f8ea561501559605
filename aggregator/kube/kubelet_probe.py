"""Whether the kubelet also checks a pod's Serve proxy (issue 27): read from the pod's spec.

A Service routes to a pod only when it is Ready: every container's readiness probe passes *and*
every readiness gate is True. Where a container's readiness probe checks the Serve proxy (as
the probe KubeRay injects into RayService workers does), our label or condition is only ANDed
with the kubelet's own check of the same proxy: fail static (PANIC) cannot keep a timing-out
worker in service, and no proxy by design cannot make a HeadOnly worker Ready. This module
finds such probes; the aggregator shows them (``Pod.kubelet_checks_serve``) and warns once per
Ray cluster (:class:`KubeletWarnings`).

A probe checks the proxy when it is an ``exec`` whose command names ``/-/healthz`` or the
serve port (``localhost:8000``), or an ``httpGet``, ``tcpSocket`` or ``grpc`` probe on the
serve port or the Serve gRPC port, by number or by the names ``serve`` / ``serve-grpc``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from servehealth_common.kube.pods import SERVE_GRPC_PORT_NAME, SERVE_PORT_NAME

log = logging.getLogger(__name__)

HEALTHZ = "/-/healthz"
#: Where the documentation says what this means and what to do.
DOCS = "docs/install.md#the-kubelets-readiness-probe"
HEADONLY_DOCS = "docs/install.md#headonly-workers"
#: The label KubeRay's serve Service selects (``"true"``), which KubeRay puts on workers when it
#: creates them and never changes.
KUBERAY_SERVE_LABEL = "ray.io/serve"


def checks_serve(pod: Mapping[str, Any], serve_port: int, grpc_port: int) -> bool:
    """Whether any container's readiness probe of ``pod`` checks its Serve proxy."""
    ports = {port for port in (serve_port, grpc_port) if port}
    containers = (pod.get("spec") or {}).get("containers") or []
    return any(_probe_checks(each.get("readinessProbe") or {}, ports) for each in containers)


def _probe_checks(probe: Mapping[str, Any], ports: set[int]) -> bool:
    command = " ".join(str(part) for part in (probe.get("exec") or {}).get("command") or [])
    if command:
        return HEALTHZ in command or any(re.search(rf":{port}\b", command) for port in ports)
    for kind in ("httpGet", "tcpSocket", "grpc"):
        port = (probe.get(kind) or {}).get("port")
        if port is not None and _serve_port(port, ports):
            return True
    return False


def _serve_port(port: object, ports: set[int]) -> bool:
    """A probe's port, a number or a container port's name, is a Serve port."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port) in ports
    return port in (SERVE_PORT_NAME, SERVE_GRPC_PORT_NAME)


def ready_condition(pod: Mapping[str, Any]) -> str:
    """The pod's ``Ready`` condition as the kubelet wrote it: "True", "False", "" unknown."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return str(condition.get("status") or "")
    return ""


class KubeletWarnings:
    """One WARNING per Ray cluster (not per pod) when the aggregator first tracks a pod of it
    whose readiness probe checks the Serve proxy, and one when, writing the condition alone, it
    makes a worker with no proxy by design Ready while KubeRay's serve label still selects it."""

    def __init__(self) -> None:
        self._warned: set[tuple[str, str]] = set()
        self._routed: set[tuple[str, str]] = set()

    def no_proxy_routed(
        self, namespace: str, cluster: str, pod_name: str, labels: Mapping[str, str]
    ) -> None:
        """``pod_name`` gets the condition True with no proxy by design (a HeadOnly worker) and
        no label of ours: if it carries KubeRay's ``ray.io/serve: "true"``, the serve Service
        will route to it once it is Ready, and its proxy port refuses that traffic."""
        key = (namespace, cluster or pod_name)
        if labels.get(KUBERAY_SERVE_LABEL) != "true" or key in self._routed:
            return
        self._routed.add(key)
        log.warning(
            "Ray cluster %s/%s: pod %s has no Serve proxy by design (HeadOnly) and gets the "
            "condition True, so it turns Ready; it still carries %s=true (KubeRay's, set when "
            "it was created), so KubeRay's serve Service sends it traffic its missing proxy "
            "refuses. --mode condition writes no label: run --mode both with "
            "--pod-selector ray.io/node-type=worker (%s)",
            namespace,
            cluster or "-",
            pod_name,
            KUBERAY_SERVE_LABEL,
            HEADONLY_DOCS,
        )

    def seen(self, namespace: str, cluster: str, pod_name: str, checks: bool) -> None:
        key = (namespace, cluster or pod_name)
        if not checks or key in self._warned:
            return
        self._warned.add(key)
        log.warning(
            "Ray cluster %s/%s: the kubelet's readiness probe of pod %s also checks the Serve "
            "proxy (KubeRay injects one into RayService workers that declare none): a Service "
            "routes to its pods only when both agree, so fail static (PANIC) cannot keep a "
            "worker whose proxy times out in service, and a worker with no proxy by design "
            "never becomes Ready; declare a readiness probe without the proxy check (%s)",
            namespace,
            cluster or "-",
            pod_name,
            DOCS,
        )
