"""The leader election's Lease in the Kubernetes API, and where its name, namespace and the
candidate's identity come from.

:class:`KubeLeaseStore` is the thin adapter behind :class:`aggregator.leader.elector.LeaderElector`:
``read``/``create``/``replace`` of one ``coordination.k8s.io/v1`` Lease through
:class:`~aggregator.kube.api.KubeApi`, keeping what it last read or wrote so that a replace
carries that resourceVersion (409 if someone wrote in between) and keeps the Lease's labels and
annotations, as client-go's ``LeaseLock`` does.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubernetes import client

from aggregator.kube.api import KubeApi
from aggregator.leader.elector import ElectionSettings, LeaderElector, Lease, LeaseRecord
from servehealth_common.kube.errors import APINotFoundError

#: Where a pod finds its own namespace (the ServiceAccount's projected volume).
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
API_VERSION = "coordination.k8s.io/v1"
LABELS = {"app.kubernetes.io/name": "ray-serve-health", "app.kubernetes.io/component": "aggregator"}


class LeaderElectionConfigError(Exception):
    """Leader election cannot start with these settings (no namespace, wrong backend)."""


def lease_namespace(
    configured: str, environ: Mapping[str, str], namespace_file: Path = NAMESPACE_FILE
) -> str:
    """``--leader-elect-namespace``, else ``$POD_NAMESPACE``, else the pod's own namespace."""
    if given := configured or environ.get("POD_NAMESPACE"):
        return given
    try:
        found = namespace_file.read_text().strip()
    except OSError:
        found = ""
    if found:
        return found
    raise LeaderElectionConfigError(
        "--leader-elect needs the namespace of its Lease: pass --leader-elect-namespace, set "
        f"POD_NAMESPACE (the downward API), or run in a pod ({namespace_file} is missing)"
    )


def candidate_identity(
    configured: str, environ: Mapping[str, str], hostname: str | None = None
) -> str:
    """``--leader-elect-identity`` as given, else ``$POD_NAME`` (or the host name) plus a random
    suffix, like client-go's ``hostname_uuid``: a restarted process never mistakes its
    predecessor's Lease for its own."""
    if configured:
        return configured
    base = environ.get("POD_NAME") or hostname or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def spec_of(record: LeaseRecord) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.duration_seconds,
        "leaseTransitions": record.transitions,
    }
    if record.acquire_time:
        spec["acquireTime"] = record.acquire_time
    if record.renew_time:
        spec["renewTime"] = record.renew_time
    return spec


def record_of(spec: Mapping[str, Any]) -> LeaseRecord:
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
        acquire_time=str(spec.get("acquireTime") or ""),
        renew_time=str(spec.get("renewTime") or ""),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


class KubeLeaseStore:
    """One Lease, ``namespace/name``, through ``api`` (whose timeout bounds each request)."""

    def __init__(self, api: KubeApi, namespace: str, name: str) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self._last: dict[str, Any] | None = None

    def describe(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _remember(self, body: dict[str, Any]) -> str:
        self._last = body
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def get(self) -> Lease | None:
        try:
            body = await self.api.get_lease(self.namespace, self.name)
        except APINotFoundError:
            self._last = None
            return None
        version = self._remember(body)
        return Lease(record_of(body.get("spec") or {}), version)

    def _body(self, record: LeaseRecord, **metadata: Any) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace, **metadata},
            "spec": spec_of(record),
        }

    async def create(self, record: LeaseRecord) -> str:
        body = self._body(record, labels=LABELS)
        return self._remember(await self.api.create_lease(self.namespace, body))

    async def update(self, record: LeaseRecord, version: str) -> str:
        last = (self._last or {}).get("metadata", {})
        kept = {
            key: last[key] for key in ("labels", "annotations", "ownerReferences") if key in last
        }
        body = self._body(record, resourceVersion=version, **kept)
        return self._remember(await self.api.replace_lease(self.namespace, self.name, body))

    def close(self) -> None:
        self.api.close()


def lease_api(
    configuration: client.Configuration,
    timings: ElectionSettings,
    on_denied: Callable[[str, str], None] | None = None,
) -> KubeApi:
    """A Kubernetes client for the Lease alone: two threads (renewals never queue behind label
    writes), each request bounded by the election's call timeout, and no urllib3 retries (a
    read timeout would otherwise be retried three times; the elector retries itself)."""
    configuration.retries = 0
    return KubeApi(
        configuration,
        timeout=timings.call_timeout,
        concurrency=2,
        user_agent="ray-serve-health/leader-election",
        on_denied=on_denied,
    )


def make_elector(
    configuration: client.Configuration,
    *,
    namespace: str,
    lease_name: str,
    identity: str,
    timings: ElectionSettings,
    on_renew_failure: Callable[[], None],
    on_denied: Callable[[str, str], None] | None = None,
) -> tuple[LeaderElector, KubeLeaseStore]:
    """The elector of Lease ``namespace/lease_name``, with a Kubernetes client of its own."""
    api = lease_api(configuration, timings, on_denied)
    store = KubeLeaseStore(api, namespace, lease_name)
    return LeaderElector(store, identity, timings, on_renew_failure=on_renew_failure), store
