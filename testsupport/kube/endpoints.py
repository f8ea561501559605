"""EndpointSlices for the API emulator's Services: where a cluster decides the traffic.

:class:`EndpointSlices` does for the emulator what Kubernetes' EndpointSlice controller
(pkg/controller/endpointslice, staging/src/k8s.io/endpointslice) does: for every Service with a
selector, it keeps ``discovery.k8s.io/v1`` EndpointSlices (label
``kubernetes.io/service-name: <service>``, ``endpointslice.kubernetes.io/managed-by:
endpointslice-controller.k8s.io``, owned by the Service) listing the pods of the Service's
namespace that match its selector, have an IP and are not in a terminal phase
(``ShouldPodBeInEndpoints`` with terminating pods included), each with the conditions
``podToEndpoint`` gives it:

- ``serving`` = the pod is Ready (its ``Ready`` condition is True);
- ``terminating`` = the pod has a ``deletionTimestamp``;
- ``ready`` = serving and not terminating (a terminating pod is ``ready: false`` but may be
  ``serving: true``); with ``publishNotReadyAddresses``, ``ready`` is always true.

It follows the emulator's store (``KubeEmulator.subscribe``): every change to a pod or a
Service is reflected at once, and a slice is written only when it changes (watches see it,
resourceVersions move). Services and EndpointSlices live in the emulator's store (the
controller declares ``v1/services`` and ``discovery.k8s.io/v1/endpointslices`` on the emulator
if it lacks them), so they can be read over HTTP too; :meth:`EndpointSlices.add_service` creates
a Service, and one created over HTTP is served just the same.

Ports: each Service port's ``targetPort`` (a number, or a container port's name, looked up in
each pod; absent: ``port``) is resolved per pod, and pods with the same resolved ports share a
slice (the controller's grouping); a pod lacking a named port gets a slice without that port.

A test asks: :meth:`EndpointSlices.endpoints` ("which pods does this Service route to now?"),
:meth:`EndpointSlices.conditions`, :meth:`EndpointSlices.wait_endpoints`, and
:meth:`EndpointSlices.settle` before asserting that something did *not* change.

Not emulated: the 100-endpoints-per-slice limit, topology (zones, hints), dual-stack (IPv4
only), Services without a selector (left alone), the controller's batching delay
(``--endpointslice-updates-batch-period``, 0 by default), the legacy ``v1/Endpoints``, and
graceful deletion itself (a test marks a pod terminating by setting its
``metadata.deletionTimestamp``; the emulator's DELETE is immediate).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import kmock

from testsupport.kube.emulator import PODS, KubeEmulator, StoreChange

log = logging.getLogger(__name__)

SERVICES = kmock.resource("", "v1", "services")
ENDPOINT_SLICES = kmock.resource("discovery.k8s.io", "v1", "endpointslices")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
CONTROLLER_NAME = "endpointslice-controller.k8s.io"

#: The serve Service KubeRay creates for a RayService: ``<rayservice>-serve-svc``.
SERVE_SERVICE_SUFFIX = "-serve-svc"


def serve_service_name(rayservice: str) -> str:
    return f"{rayservice}{SERVE_SERVICE_SUFFIX}"


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    metadata = obj.get("metadata") or {}
    return metadata.get("namespace") or "", metadata.get("name") or ""


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    """``IsPodReady``: the pod's Ready condition is True."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _in_endpoints(pod: Mapping[str, Any]) -> bool:
    """``ShouldPodBeInEndpoints(pod, includeTerminating=true)``."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return False
    return bool(status.get("podIP") or status.get("podIPs"))


def _target_port(pod: Mapping[str, Any], port: Mapping[str, Any]) -> int | None:
    """``podutil.FindPort``: a number, or a container port of that name (and protocol)."""
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    protocol = port.get("protocol", "TCP")
    for container in (pod.get("spec") or {}).get("containers") or []:
        for declared in container.get("ports") or []:
            if declared.get("name") == target and declared.get("protocol", "TCP") == protocol:
                return int(declared["containerPort"])
    return None


class EndpointSlices:
    """The EndpointSlice controller of a :class:`KubeEmulator` (module docstring).

    ``async with EndpointSlices(kube) as slices:``, ``slices.add_service("ray-serve-svc",
    {"ray.io/serve": "true"})``, then ``slices.endpoints("ray-serve-svc")``.
    """

    def __init__(self, kube: KubeEmulator) -> None:
        self.kube = kube
        self._queue: asyncio.Queue[StoreChange] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._busy = False
        self._changed = asyncio.Event()
        self.writes = 0  # slice creations, updates and deletions made

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> EndpointSlices:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def start(self) -> None:
        verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
        if SERVICES not in self.kube.resources:
            self.kube.resources[SERVICES] = kmock.ResourceInfo(
                kind="Service",
                singular="service",
                namespaced=True,
                verbs=verbs,
                shortnames={"svc"},
                subresources={"status"},
            )
        if ENDPOINT_SLICES not in self.kube.resources:
            self.kube.resources[ENDPOINT_SLICES] = kmock.ResourceInfo(
                kind="EndpointSlice", singular="endpointslice", namespaced=True, verbs=verbs
            )
        self._queue = self.kube.subscribe()
        for service in self.kube.list_objects(SERVICES):
            self._reconcile(*_key(service))
        self._follower = asyncio.create_task(self._follow(), name="endpointslice-controller")

    async def stop(self) -> None:
        if self._queue is not None:
            self.kube.unsubscribe(self._queue)
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)

    # ---- Services ------------------------------------------------------------------------------

    def add_service(
        self,
        name: str,
        selector: Mapping[str, str],
        *,
        namespace: str = "default",
        ports: Sequence[Mapping[str, Any]] = (
            {"name": "serve", "port": 8000, "targetPort": "serve", "protocol": "TCP"},
        ),
        publish_not_ready_addresses: bool = False,
        labels: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Create (or replace) a ClusterIP Service in the store; its slices follow at once.
        The default port is KubeRay's serve Service's: 8000, ``targetPort: serve``."""
        digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
        service: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": {
                "type": "ClusterIP",
                "clusterIP": f"10.96.{digest[0]}.{digest[1] or 1}",
                "selector": dict(selector),
                "ports": [dict(port) for port in ports],
                "publishNotReadyAddresses": publish_not_ready_addresses,
            },
        }
        stored = self.kube.put_object(SERVICES, service)
        self._reconcile(namespace, name)
        return stored

    def remove_service(self, name: str, namespace: str = "default") -> None:
        self.kube.delete_object(SERVICES, namespace, name)
        self._reconcile(namespace, name)

    def service(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.kube.get_object(SERVICES, namespace, name)

    # ---- what a test reads --------------------------------------------------------------------

    def slices(self, name: str, namespace: str = "default") -> list[dict[str, Any]]:
        """The Service's EndpointSlices as stored now (copies, by name)."""
        return sorted(
            (copy.deepcopy(dict(item)) for item in self._stored_slices(name, namespace)),
            key=lambda item: item["metadata"]["name"],
        )

    def _stored_slices(self, name: str, namespace: str) -> list[Mapping[str, Any]]:
        """The stored slices themselves (not copies: read only)."""
        return [
            item
            for item in self.kube.peek_objects(ENDPOINT_SLICES, namespace)
            if (item["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == name
        ]

    def conditions(self, name: str, namespace: str = "default") -> dict[str, dict[str, bool]]:
        """Each endpoint's pod name and conditions (``ready``, ``serving``, ``terminating``)."""
        found: dict[str, dict[str, bool]] = {}
        for item in self._stored_slices(name, namespace):
            for endpoint in item.get("endpoints") or []:
                pod = (endpoint.get("targetRef") or {}).get("name", "")
                found[pod] = dict(endpoint.get("conditions") or {})
        return found

    def endpoints(self, name: str, namespace: str = "default") -> set[str]:
        """The pods the Service routes to now: its endpoints with ``ready: true``."""
        return {pod for pod, c in self.conditions(name, namespace).items() if c.get("ready")}

    def is_endpoint(self, pod: str, service: str, namespace: str = "default") -> bool:
        return pod in self.endpoints(service, namespace)

    async def wait_endpoints(
        self, name: str, expected: Iterable[str], *, namespace: str = "default", within: float = 5.0
    ) -> set[str]:
        """Wait until the Service's ready endpoints are exactly ``expected`` (AssertionError
        after ``within`` seconds, saying what they were)."""
        wanted = set(expected)
        try:
            await self.kube.wait_until(
                lambda: self.endpoints(name, namespace) == wanted, within=within
            )
        except AssertionError:
            raise AssertionError(
                f"endpoints of {namespace}/{name}: wanted {sorted(wanted)}, "
                f"still {sorted(self.endpoints(name, namespace))} after {within}s"
            ) from None
        return wanted

    async def wait(self, predicate: Callable[[], Any], within: float = 5.0) -> Any:
        """``kube.wait_until``: slices are in the store, so every change wakes it."""
        return await self.kube.wait_until(predicate, within=within)

    async def settle(self, within: float = 5.0) -> None:
        """Wait until every store change so far is reflected in the slices."""
        try:
            async with asyncio.timeout(within):
                while self._queue is None or not self._queue.empty() or self._busy:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"the EndpointSlice controller did not settle in {within}s"
            ) from None

    # ---- the controller -------------------------------------------------------------------------

    async def _follow(self) -> None:
        assert self._queue is not None
        while True:
            # A burst of changes is one pass: each Service it touches reconciled once (from
            # the store as it is now, as the controller's work queue coalesces keys).
            changes = [await self._queue.get()]
            while not self._queue.empty():
                changes.append(self._queue.get_nowait())
            self._busy = True
            try:
                touched: set[tuple[str, str]] = set()
                for change in changes:
                    touched |= self._touched(change)
                for namespace, name in sorted(touched):
                    self._reconcile(namespace, name)
            except Exception:
                log.exception("endpointslices: handling %d change(s) failed", len(changes))
            finally:
                self._busy = self._queue.qsize() > 0
                self._changed.set()

    def _touched(self, change: StoreChange) -> set[tuple[str, str]]:
        """The Services whose slices a change may change."""
        if change.resource == SERVICES:
            return {_key(change.obj)}
        if change.resource != PODS:
            return set()
        namespace = _key(change.obj)[0]
        touched = set()
        for service in self.kube.peek_objects(SERVICES, namespace):
            selector = (service.get("spec") or {}).get("selector") or {}
            if any(
                selector and _labels_match(selector, obj)
                for obj in (change.obj, change.prev)
                if obj is not None
            ):
                touched.add((namespace, service["metadata"]["name"]))
        return touched

    def _reconcile(self, namespace: str, name: str) -> None:
        service = self.kube.get_object(SERVICES, namespace, name)
        selector = ((service or {}).get("spec") or {}).get("selector") or {}
        existing = {item["metadata"]["name"]: item for item in self._stored_slices(name, namespace)}
        if service is None or not selector:  # gone, or not ours to manage
            if service is None:
                for slice_name in existing:
                    self.kube.delete_object(ENDPOINT_SLICES, namespace, slice_name)
                    self.writes += 1
            return
        desired = self._desired(service)
        for slice_name, item in desired.items():
            current = existing.get(slice_name)
            if current is not None and _same(current, item):
                continue
            self.kube.put_object(ENDPOINT_SLICES, item)
            self.writes += 1
        for slice_name in existing.keys() - desired.keys():
            self.kube.delete_object(ENDPOINT_SLICES, namespace, slice_name)
            self.writes += 1

    def _desired(self, service: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        namespace, name = _key(service)
        spec = service.get("spec") or {}
        selector = spec.get("selector") or {}
        publish = bool(spec.get("publishNotReadyAddresses"))
        groups: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
        for pod in sorted(self.kube.peek_objects(PODS, namespace), key=_key):
            if not _labels_match(selector, pod) or not _in_endpoints(pod):
                continue
            ports = []
            for port in spec.get("ports") or []:
                target = _target_port(pod, port)
                if target is None:
                    continue  # "Failed to find port for service": the pod goes without it
                entry = {
                    "name": port.get("name", ""),
                    "port": target,
                    "protocol": port.get("protocol", "TCP"),
                }
                if port.get("appProtocol"):
                    entry["appProtocol"] = port["appProtocol"]
                ports.append(entry)
            group = hashlib.sha256(json.dumps(ports, sort_keys=True).encode()).hexdigest()[:5]
            groups.setdefault(group, (ports, []))[1].append(self._endpoint(pod, publish))
        if not groups:  # the controller keeps a placeholder slice for a Service with no pods
            groups["place"] = ([], [])
        owner = {
            "apiVersion": "v1",
            "kind": "Service",
            "name": name,
            "uid": service["metadata"].get("uid", ""),
            "controller": True,
            "blockOwnerDeletion": True,
        }
        labels = {
            **{
                key: value
                for key, value in (service["metadata"].get("labels") or {}).items()
                if key not in (SERVICE_NAME_LABEL, MANAGED_BY_LABEL)
            },
            SERVICE_NAME_LABEL: name,
            MANAGED_BY_LABEL: CONTROLLER_NAME,
        }
        desired = {}
        for group, (ports, endpoints) in sorted(groups.items()):
            slice_name = f"{name}-{group}"
            desired[slice_name] = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": slice_name,
                    "namespace": namespace,
                    "labels": labels,
                    "ownerReferences": [owner],
                },
                "addressType": "IPv4",
                "endpoints": sorted(endpoints, key=lambda e: e["targetRef"]["name"]),
                "ports": ports,
            }
        return desired

    @staticmethod
    def _endpoint(pod: Mapping[str, Any], publish_not_ready: bool) -> dict[str, Any]:
        """``podToEndpoint``."""
        serving = _pod_ready(pod)
        terminating = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
        ready = publish_not_ready or (serving and not terminating)
        status = pod.get("status") or {}
        endpoint: dict[str, Any] = {
            "addresses": [status.get("podIP") or (status.get("podIPs") or [{}])[0].get("ip")],
            "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            "targetRef": {
                "kind": "Pod",
                "namespace": pod["metadata"].get("namespace"),
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"].get("uid", ""),
            },
        }
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            endpoint["nodeName"] = node
        return endpoint


def _labels_match(selector: Mapping[str, str], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in selector.items())


def _same(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    keys = ("addressType", "endpoints", "ports")
    return all(current.get(key) == desired.get(key) for key in keys) and all(
        current["metadata"].get(key) == desired["metadata"].get(key)
        for key in ("labels", "ownerReferences")
    )


__all__ = [
    "ENDPOINT_SLICES",
    "SERVICES",
    "EndpointSlices",
    "serve_service_name",
]
