"""A Kubernetes API server emulator for the product's tests: kmock's emulator, extended.

kmock 0.8 (``kmock.KubernetesEmulator``) natively gives: an aiohttp server on a loopback port
(``kmock.Server``), URL parsing into resource/namespace/name/subresource, API discovery from
``kmock.resources``, an in-memory object store with per-object history (``kmock.objects``),
create/get/list/patch/delete of objects, a watch stream, every request recorded and filterable
(``kmock[criteria]``), and the DSL for canned responses (``kmock[criteria][slice] << 429 << ...``).

It does not give what the product relies on, so :class:`KubeEmulator` (a subclass, as kmock's
docstring invites) adds it, following the documented API semantics
(https://kubernetes.io/docs/reference/using-api/api-concepts/):

- ``metadata.resourceVersion``: one global, increasing counter (like etcd's revision) stamped on
  every write and on list responses; ``uid`` and ``creationTimestamp`` on create.
- Label selectors (``key``, ``!key``, ``=``, ``==``, ``!=``, ``in``, ``notin``, ``>``, ``<``;
  comma = AND; bad syntax answers 400) and field selectors (``=``, ``==``, ``!=`` on
  ``metadata.name``, ``metadata.namespace`` and, for pods, ``spec.nodeName``, ``status.phase``,
  ``status.podIP`` and the other fields the API server indexes; unknown fields answer 400) on
  lists and watches. ``limit``/``continue`` pagination.
- Watches that start from a resourceVersion: only changes after it, in order, each object with
  its new resourceVersion; no resourceVersion (or ``"0"``) first replays the current objects as
  ``ADDED``. A resourceVersion older than the kept history (``compact()``, ``history_limit``)
  answers HTTP 200 with one ``ERROR`` event carrying ``Status{code: 410, reason: Expired}``, as
  the API server's watch cache does. With a selector, an object that stops matching is sent as
  ``DELETED`` (its previous content, the change's resourceVersion) and one that starts matching
  as ``ADDED`` (the watch cache's ``convertToWatchEvent``). ``timeoutSeconds`` ends the stream,
  ``allowWatchBookmarks`` enables ``BOOKMARK`` events (``bookmark()``, and one before a timeout),
  ``drop_watches()`` ends every open stream (gracefully or by cutting the connection).
- Writes that answer an error do not happen. kmock's own ``_handle`` applies creates/patches
  before looking at reactions, so a request answered ``429`` by a DSL reaction would still change
  the object; here every write happens in the fallback handler, i.e. only if no reaction took it.
- PATCH by content type: ``application/merge-patch+json`` (RFC 7386: ``null`` deletes, lists are
  replaced), ``application/strategic-merge-patch+json`` (lists merge by their patch merge key:
  pod ``status.conditions`` by ``type``, containers by ``name``, ... see ``POD_MERGE_KEYS``;
  ``$patch: delete|replace`` and ``$deleteFromPrimitiveList`` directives; unknown lists are
  replaced), ``application/json-patch+json`` (RFC 6902). The official client sends a strategic
  merge patch for a dict body and a JSON patch for a list body unless ``_content_type`` is given.
- The ``status`` subresource: PATCH/PUT on ``pods/status`` changes only ``status`` (and metadata,
  as the pod status strategy allows), PATCH/PUT on the pod itself leaves ``status`` as it was.
- Optimistic concurrency: a PATCH or PUT whose body carries a ``metadata.resourceVersion`` other
  than the current one answers 409 Conflict; without one it is unconditional. A write that
  changes nothing keeps the resourceVersion and emits no watch event (as the API server does).
- PUT (replace), which kmock does not route at all; ``dryRun``; ``generateName``.
- Resources served: ``v1/pods`` (with ``status``), ``v1/events``, ``events.k8s.io/v1/events``,
  ``coordination.k8s.io/v1/leases``; declare more with ``emulator.resources[...] =
  kmock.ResourceInfo(kind=..., namespaced=True)``.
- ``authentication.k8s.io/v1/tokenreviews`` (create only, nothing stored), answering as the API
  server does for the projected ServiceAccount tokens ``issue_token`` mints (JWT-shaped, with
  ``aud``, ``exp``, ``iat``, ``nbf``, ``jti`` and the ``kubernetes.io`` pod/node claims): an
  unknown, expired or wrong-audience token, or one whose bound pod is gone (or was replaced),
  is a 201 answer with no ``authenticated`` and an ``error``; a good one has ``authenticated:
  true``, ``audiences`` (the requested ones the token has; the API server's own when none were
  requested), and ``user`` with ``system:serviceaccount:<ns>:<name>``, the ServiceAccount
  groups and the ``authentication.kubernetes.io/{credential-id,pod-name,pod-uid,node-name,
  node-uid}`` extras (node ones since Kubernetes 1.30); an empty ``spec.token`` is 400.
  ``wall_clock`` (default ``time.time``) is what tokens expire by.
- Test-side helpers: direct store access that bypasses HTTP but still emits watch events
  (``add_pod``, ``modify_pod``, ...), request accounting with arrival times (``requests()``),
  event-driven waiting (``wait_until``, ``wait_for_watches``), and fault injection built on
  kmock's DSL (``fail_next``, ``throttle_patches``, ``pod_not_found``, ``slow``; ``drop_watches``
  is the one fault the DSL cannot express, as watches are served by the emulator, not by a
  reaction).
- ``subscribe()``: every committed change, in process (not a watch), for the test-side
  controllers that add what a cluster puts between our write and the traffic:

  - testsupport/kube/kubelet.py, a kubelet for chosen pods or a node: runs each container's
    ``readinessProbe`` (``httpGet``, ``tcpSocket``, ``grpc``, and KubeRay's injected ``exec``
    ``wget ... | grep success`` chains, parsed, never run in a shell) against loopback servers
    on its period, with ``initialDelaySeconds``, ``timeoutSeconds`` and the failure/success
    thresholds, on real or fake time, and writes ``ContainersReady`` and ``Ready`` (readiness
    gates included, re-evaluated when a gate's condition is written) into the store on change.
    It does not run liveness or startup probes, restart containers, change a pod's phase,
    initialize it, assign its IP or run any other exec command (that probe fails, with a
    WARNING).
  - testsupport/kube/endpoints.py, the EndpointSlice controller: Services (in the store) and their
    EndpointSlices (pods that match the selector, ``ready``/``serving``/``terminating`` as
    Kubernetes sets them), so that a test asks "is this pod an endpoint of
    ``<rayservice>-serve-svc``". It does not split slices at 100 endpoints, add topology, serve
    IPv6 or the legacy Endpoints, or delete gracefully (a test sets ``deletionTimestamp``).

Known differences from a real API server: no authentication/authorization/admission/validation
of the emulator's own clients (TokenReview checks only the tokens it issued, and no
ServiceAccount objects exist: a token's ServiceAccount is taken as given);
DELETE is immediate (no grace period, no finalizers); ``v1`` and ``events.k8s.io/v1`` events are
two separate stores; a list with a ``resourceVersion`` newer than the current one answers 504 at
once (the server first waits up to 3 s); a watch from a future resourceVersion simply waits;
continue pages are cut from the current state, not from a snapshot; ``resourceVersionMatch`` is
ignored (lists always show the latest state); strategic merge knows only the merge keys listed
in ``POD_MERGE_KEYS``/``METADATA_MERGE_KEYS``; server-side apply answers 415; a failing JSON
patch ``test`` answers 422; no ``managedFields``, ``generation`` or graceful deletion. Writing to
``kmock.objects`` directly bypasses resourceVersions and watches: use the store helpers. The
emulator's state must be touched only from the event loop that serves it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import hashlib
import hmac
import json
import pathlib
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from time import time as _unix_time
from types import EllipsisType
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import kubernetes

# --------------------------------------------------------------------------------------------
# Resources.

PODS = kmock.resource("", "v1", "pods")
EVENTS = kmock.resource("", "v1", "events")
EVENTS_V1 = kmock.resource("events.k8s.io", "v1", "events")
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
TOKENREVIEWS = kmock.resource("authentication.k8s.io", "v1", "tokenreviews")

#: The audience of tokens meant for the API server itself (``kubectl create token`` without
#: ``--audience``), and the issuer of every token.
API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"
TOKEN_ISSUER = "https://kubernetes.default.svc.cluster.local"

ANY: EllipsisType = ...  # "any value" in filters, as in kmock's own criteria

#: Strategic-merge-patch keys for lists, by path (list items are transparent in paths).
#: ``""`` marks a list of scalars merged as a set. Lists not named here are replaced whole.
#: From the ``patchStrategy:"merge" patchMergeKey:"..."`` tags in k8s.io/api/core/v1/types.go.
METADATA_MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("metadata", "finalizers"): "",
    ("metadata", "ownerReferences"): "uid",
}
POD_MERGE_KEYS: dict[tuple[str, ...], str] = {
    **METADATA_MERGE_KEYS,
    ("spec", "containers"): "name",
    ("spec", "initContainers"): "name",
    ("spec", "ephemeralContainers"): "name",
    ("spec", "containers", "ports"): "containerPort",
    ("spec", "containers", "env"): "name",
    ("spec", "containers", "volumeMounts"): "mountPath",
    ("spec", "initContainers", "env"): "name",
    ("spec", "volumes"): "name",
    ("spec", "imagePullSecrets"): "name",
    ("status", "conditions"): "type",
    ("status", "podIPs"): "ip",
}

#: Field selectors the API server supports, per resource (pods: pkg/registry/core/pod/strategy.go,
#: events: pkg/registry/core/event/strategy.go). Every resource supports the metadata ones.
POD_FIELDS = (
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)
EVENT_FIELDS = (
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)


def api_version_of(resource: kmock.resource) -> str:
    return resource.version if not resource.group else f"{resource.group}/{resource.version}"


def _resource_label(resource: kmock.resource) -> str:
    """How the API server names a resource in messages: ``pods``, ``leases.coordination.k8s.io``."""
    return resource.plural if not resource.group else f"{resource.plural}.{resource.group}"


# --------------------------------------------------------------------------------------------
# Errors as the API server renders them.


def status_body(
    code: int, reason: str, message: str, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A ``Status`` object, the body of every API error (and of watch ``ERROR`` events)."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = dict(details)
    return body


def api_error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    """An exception that kmock renders as a ``Status`` body with this HTTP code."""
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details)


def _not_found(resource: kmock.resource, name: str) -> kmock.KubernetesError:
    return api_error(
        404,
        "NotFound",
        f'{_resource_label(resource)} "{name}" not found',
        **_details(resource, name),
    )


def _conflict(resource: kmock.resource, name: str) -> kmock.KubernetesError:
    return api_error(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_resource_label(resource)} "{name}": the object has'
        " been modified; please apply your changes to the latest version and try again",
        **_details(resource, name),
    )


def _details(resource: kmock.resource, name: str) -> dict[str, str]:
    details = {"name": name, "kind": resource.plural}
    if resource.group:
        details["group"] = resource.group
    return details


def _bad_request(message: str) -> kmock.KubernetesError:
    return api_error(400, "BadRequest", message)


# --------------------------------------------------------------------------------------------
# Label selectors (k8s.io/apimachinery/pkg/labels/selector.go).


class SelectorError(ValueError):
    """A selector the API server would reject with 400 BadRequest."""


@dataclass(frozen=True)
class Requirement:
    """One comma-separated term of a label selector."""

    key: str
    op: str  # exists, !, =, !=, in, notin, gt, lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        match self.op:
            case "exists":
                return present
            case "!":
                return not present
            case "=" | "in":
                return present and value in self.values
            case "!=" | "notin":
                return not present or value not in self.values
            case "gt" | "lt":
                try:
                    number = int(value) if value is not None else None
                except ValueError:
                    return False
                if number is None:
                    return False
                bound = int(self.values[0])
                return number > bound if self.op == "gt" else number < bound
        raise AssertionError(self.op)  # pragma: no cover


_TOKEN = re.compile(r"\s*(?:(==|!=|=|!|\(|\)|,|<|>)|([^\s=!(),<>]+))")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}$")
_VALUE = re.compile(rf"^({_NAME})?$")


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    position = 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise SelectorError(f"unable to parse requirement: {text!r}")
        tokens.append(match.group(1) or match.group(2))
        position = match.end()
    return tokens


def parse_label_selector(text: str | None) -> tuple[Requirement, ...]:
    """Parse ``a=b,c!=d,e in (f,g),!h,i`` into requirements (all must match)."""
    if not text or not text.strip():
        return ()
    tokens = _tokenize(text)
    requirements: list[Requirement] = []
    index = 0

    def take() -> str | None:
        nonlocal index
        token = tokens[index] if index < len(tokens) else None
        index += 1
        return token

    def peek() -> str | None:
        return tokens[index] if index < len(tokens) else None

    def key(token: str | None) -> str:
        if token is None or not _KEY.match(token):
            raise SelectorError(f"invalid label key: {token!r}")
        return token

    def value(token: str) -> str:
        if not _VALUE.match(token):
            raise SelectorError(f"invalid label value: {token!r}")
        return token

    while True:
        token = take()
        if token == "!":
            requirements.append(Requirement(key(take()), "!"))
        else:
            name = key(token)
            operator = peek()
            if operator in (None, ","):
                requirements.append(Requirement(name, "exists"))
            elif operator in ("=", "==", "!="):
                take()
                following = peek()
                if following in (None, ","):
                    text_value = ""  # `key=` selects the empty value
                elif following in ("(", ")", "=", "!", "<", ">", "==", "!="):
                    raise SelectorError(f"unexpected {following!r} after {name}{operator}")
                else:
                    text_value = value(take() or "")
                op = "!=" if operator == "!=" else "="
                requirements.append(Requirement(name, op, (text_value,)))
            elif operator in ("in", "notin"):
                take()
                if take() != "(":
                    raise SelectorError(f"expected '(' after {name} {operator}")
                values: list[str] = []
                while True:
                    item = take()
                    if item == ")" and not values:
                        raise SelectorError(f"for '{operator}', the set of values can't be empty")
                    if item in (",", ")"):
                        values.append("")  # an empty member, as in `in (a,)`
                        if item == ")":
                            break
                        continue
                    if item is None or item in ("(", "=", "!", "<", ">", "==", "!="):
                        raise SelectorError(f"unterminated value set for {name}")
                    values.append(value(item))
                    closing = take()
                    if closing == ")":
                        break
                    if closing != ",":
                        raise SelectorError(f"expected ',' or ')' in the values of {name}")
                requirements.append(Requirement(name, operator, tuple(values)))
            elif operator in ("<", ">"):
                take()
                bound = take()
                if bound is None or not re.fullmatch(r"-?\d+", bound):
                    raise SelectorError(f"for '{operator}', the value must be an integer")
                requirements.append(Requirement(name, "gt" if operator == ">" else "lt", (bound,)))
            else:
                raise SelectorError(f"unexpected {operator!r} after the key {name!r}")
        separator = take()
        if separator is None:
            return tuple(requirements)
        if separator != ",":
            raise SelectorError(f"expected ',' between requirements, found {separator!r}")


def labels_match(requirements: Iterable[Requirement], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    return all(requirement.matches(labels) for requirement in requirements)


# --------------------------------------------------------------------------------------------
# Field selectors (k8s.io/apimachinery/pkg/fields/selector.go; only `=`, `==`, `!=`).


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    value: str
    negated: bool = False

    def matches(self, obj: Mapping[str, Any]) -> bool:
        return (field_value(obj, self.path) == self.value) != self.negated


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string form of a field, as the API server indexes it (absent = empty string)."""
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if isinstance(node, bool):
        return "true" if node else "false"
    if isinstance(node, Mapping) and path == "source":  # events: source.component
        return str(node.get("component", ""))
    return "" if node is None else str(node)


def parse_field_selector(
    text: str | None, supported: Iterable[str]
) -> tuple[FieldRequirement, ...]:
    if not text or not text.strip():
        return ()
    allowed = {"metadata.name", "metadata.namespace", *supported}
    requirements = []
    for term in re.split(r"(?<!\\),", text):
        match = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)(.*)", term)
        if match is None:
            raise SelectorError(f"invalid selector: {text!r}; can't understand {term!r}")
        path, operator, value = match.groups()
        if path not in allowed:
            raise SelectorError(f'field label not supported: "{path}"')
        value = re.sub(r"\\(.)", r"\1", value.strip())
        requirements.append(FieldRequirement(path, value, negated=operator == "!="))
    return tuple(requirements)


# --------------------------------------------------------------------------------------------
# Patches.


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, ``null`` removes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(
    target: Any,
    patch: Any,
    merge_keys: Mapping[tuple[str, ...], str],
    path: tuple[str, ...] = (),
) -> Any:
    """Kubernetes' strategic merge patch, for the lists named in ``merge_keys``.

    Like a JSON merge patch, except that a list with a merge key merges item by item: an item
    whose key matches an existing item is merged into it (recursively), a new one is appended,
    an item with ``"$patch": "delete"`` removes the existing one. ``"$patch": "replace"`` in a map
    (or as a list item) replaces instead of merging; ``$deleteFromPrimitiveList/<field>`` removes
    scalars from a set-like list; ``$setElementOrder/...`` and ``$retainKeys`` are ignored.
    """
    if not isinstance(patch, Mapping):
        return _strip_directives(patch)
    if patch.get("$patch") == "replace":
        return _strip_directives(patch)
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [item for item in result.get(name) or [] if item not in value]
            continue
        subpath = (*path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping):
            merged = strategic_merge_patch(result.get(key), value, merge_keys, subpath)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and subpath in merge_keys:
            result[key] = _merge_list(result.get(key) or [], value, merge_keys, subpath)
        else:
            result[key] = _strip_directives(value)
    return result


def _merge_list(
    target: list[Any],
    patch: list[Any],
    merge_keys: Mapping[tuple[str, ...], str],
    path: tuple[str, ...],
) -> list[Any]:
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in patch):
        return [
            _strip_directives(item)
            for item in patch
            if not (isinstance(item, Mapping) and set(item) == {"$patch"})
        ]
    merge_key = merge_keys[path]
    result = copy.deepcopy(list(target))
    for item in patch:
        if not merge_key or not isinstance(item, Mapping):
            if item not in result:
                result.append(copy.deepcopy(item))
            continue
        index = next(
            (
                position
                for position, existing in enumerate(result)
                if isinstance(existing, Mapping) and existing.get(merge_key) == item.get(merge_key)
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is not None:
            result[index] = strategic_merge_patch(result[index], item, merge_keys, path)
        else:
            result.append(_strip_directives(item))
    return result


def _combine_merge_patches(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """One merge patch with the effect of ``first`` then ``second`` (nulls are kept)."""
    result = copy.deepcopy(dict(first))
    for key, value in second.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = _combine_merge_patches(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _strip_directives(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            key: _strip_directives(item)
            for key, item in value.items()
            if not key.startswith("$") and item is not None
        }
    if isinstance(value, list):
        return [_strip_directives(item) for item in value]
    return copy.deepcopy(value)


# --------------------------------------------------------------------------------------------
# Objects.

DEFAULT_POD_LABELS = {
    "ray.io/cluster": "raycluster",
    "ray.io/node-type": "worker",
    "ray.io/is-ray-node": "yes",
}


def make_pod(
    namespace: str = "default",
    name: str = "ray-worker-0",
    *,
    labels: Mapping[str, str] | None = None,
    node_name: str | None = "node-1",
    pod_ip: str | None = None,
    serve_port: int | None = 8000,
    readiness_gates: Sequence[str] = (),
    phase: str = "Running",
    conditions: Sequence[Mapping[str, Any]] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A KubeRay-like Ray pod manifest (``labels=None`` gives ``DEFAULT_POD_LABELS``).

    ``serve_port`` becomes a container port named ``serve`` (None: no port); each of
    ``readiness_gates`` becomes ``spec.readinessGates[].conditionType``; ``conditions`` defaults
    to PodScheduled/Initialized/ContainersReady/Ready all ``True``.
    """
    container: dict[str, Any] = {"name": "ray-worker", "image": "rayproject/ray:2.50.0"}
    if serve_port is not None:
        container["ports"] = [{"name": "serve", "containerPort": serve_port, "protocol": "TCP"}]
    spec: dict[str, Any] = {"containers": [container], "restartPolicy": "Always"}
    if node_name is not None:
        spec["nodeName"] = node_name
    if readiness_gates:
        spec["readinessGates"] = [{"conditionType": gate} for gate in readiness_gates]
    if conditions is None:
        conditions = [
            {"type": kind, "status": "True"}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
    status: dict[str, Any] = {"phase": phase, "conditions": [dict(c) for c in conditions]}
    if pod_ip is not None:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": dict(DEFAULT_POD_LABELS if labels is None else labels),
    }
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _without_version(obj: Mapping[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(dict(obj))
    stripped.get("metadata", {}).pop("resourceVersion", None)
    return stripped


# --------------------------------------------------------------------------------------------
# Request accounting.


@dataclass(frozen=True)
class ApiCall:
    """One request that reached the emulator (whatever answered it: a fault or the store)."""

    method: str  # GET, POST, PUT, PATCH, DELETE
    verb: str  # as in RBAC: get, list, watch, create, update, patch, delete
    path: str
    resource: str | None  # plural, e.g. "pods"
    group: str | None
    subresource: str | None  # e.g. "status"
    namespace: str | None
    name: str | None
    params: Mapping[str, str]
    headers: Mapping[str, str]
    body: Any  # parsed JSON, or None
    at: float  # event-loop time (``loop.time()``) of arrival
    request: kmock.Request = field(repr=False)

    @property
    def content_type(self) -> str | None:
        return _header(self.headers, "Content-Type")


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name.lower():
            return value
    return None


def _verb(request: kmock.Request) -> str:
    method = str(request.method.value).upper()
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    return {
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if request.name else "deletecollection",
    }.get(method, method.lower())


def peak_count(calls: Sequence[ApiCall], window: float = 1.0) -> int:
    """The largest number of ``calls`` that arrived within any ``window`` seconds."""
    times = sorted(call.at for call in calls)
    best = 0
    start = 0
    for end, time in enumerate(times):
        while time - times[start] >= window:
            start += 1
        best = max(best, end - start + 1)
    return best


def _as_resource(resource: str | kmock.resource) -> kmock.resource:
    """``"pods"`` (plural only, any group), ``"v1/pods"``, ``"leases.v1.coordination.k8s.io"``."""
    if isinstance(resource, kmock.resource):
        return resource
    return kmock.resource(resource)


# --------------------------------------------------------------------------------------------
# ServiceAccount tokens (k8s.io/kubernetes/pkg/serviceaccount: claims.go, jwt.go).


@dataclass(frozen=True)
class IssuedToken:
    """What the emulator knows of a token it issued (``KubeEmulator.issue_token``)."""

    namespace: str
    service_account: str
    audiences: tuple[str, ...]
    issued_at: int  # seconds since the epoch (``iat``, ``nbf``)
    expires_at: int  # ``exp``
    jti: str
    pod_name: str | None = None
    pod_uid: str | None = None
    node_name: str | None = None
    node_uid: str | None = None

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    def claims(self) -> dict[str, Any]:
        """The JWT claims of a projected token, as the API server writes them."""
        private: dict[str, Any] = {
            "namespace": self.namespace,
            "serviceaccount": {
                "name": self.service_account,
                "uid": service_account_uid(self.namespace, self.service_account),
            },
        }
        if self.pod_name is not None:
            private["pod"] = {"name": self.pod_name, "uid": self.pod_uid}
        if self.node_name is not None:
            private["node"] = {"name": self.node_name, "uid": self.node_uid}
        return {
            "aud": list(self.audiences),
            "exp": self.expires_at,
            "iat": self.issued_at,
            "nbf": self.issued_at,
            "iss": TOKEN_ISSUER,
            "jti": self.jti,
            "sub": self.username,
            "kubernetes.io": private,
        }

    def user(self) -> dict[str, Any]:
        """``status.user`` of a successful review."""
        extra = {"authentication.kubernetes.io/credential-id": [f"JTI={self.jti}"]}
        if self.pod_name is not None:
            extra["authentication.kubernetes.io/pod-name"] = [self.pod_name]
            extra["authentication.kubernetes.io/pod-uid"] = [self.pod_uid or ""]
        if self.node_name is not None:
            extra["authentication.kubernetes.io/node-name"] = [self.node_name]
            extra["authentication.kubernetes.io/node-uid"] = [self.node_uid or ""]
        return {
            "username": self.username,
            "uid": service_account_uid(self.namespace, self.service_account),
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{self.namespace}",
                "system:authenticated",
            ],
            "extra": extra,
        }


def service_account_uid(namespace: str, name: str) -> str:
    """A stable uid for a ServiceAccount the emulator does not store."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"serviceaccount/{namespace}/{name}"))


def node_uid(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"node/{name}"))


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# --------------------------------------------------------------------------------------------
# The emulator.


@dataclass(frozen=True)
class _Change:
    rv: int
    resource: kmock.resource
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]  # the new state (for DELETED: the last state, with the deletion's RV)
    prev: dict[str, Any] | None


#: One committed change, as ``KubeEmulator.subscribe`` delivers it.
StoreChange = _Change

_DROP = object()
_ABORT = object()


@dataclass(frozen=True)
class _Bookmark:
    rv: int


@dataclass(eq=False)
class _Watch:
    resource: kmock.resource
    namespace: str | None
    labels: tuple[Requirement, ...]
    fields: tuple[FieldRequirement, ...]
    bookmarks: bool
    request: kmock.Request
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        metadata = obj.get("metadata", {})
        return (
            (self.namespace is None or metadata.get("namespace") == self.namespace)
            and labels_match(self.labels, metadata.get("labels"))
            and all(requirement.matches(obj) for requirement in self.fields)
        )

    def event_for(self, change: _Change) -> dict[str, Any] | None:
        """What this watcher sees of a change (the watch cache's ``convertToWatchEvent``)."""
        if change.resource != self.resource:
            return None
        current = change.type != "DELETED" and self.matches(change.obj)
        previous = self.matches(change.prev)
        if current:
            return {"type": "MODIFIED" if previous else "ADDED", "object": change.obj}
        if previous:
            assert change.prev is not None
            gone = copy.deepcopy(change.prev)
            gone.setdefault("metadata", {})["resourceVersion"] = str(change.rv)
            return {"type": "DELETED", "object": gone}
        return None


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the API semantics the product relies on (module doc).

    Use it as kmock's own: ``async with KubeEmulator() as kube, kmock.Server(kube): ...``, then
    ``await kube.close()`` before the server stops (the ``kube_emulator`` fixture does all that).
    ``kube.url`` is the base URL; ``kube[criteria]`` is kmock's DSL; ``kube.objects`` is kmock's
    store (one history per object).
    """

    #: Keep at most this many changes for watches to resume from (None: unlimited). A watch from
    #: a resourceVersion older than the kept history answers 410 Expired.
    history_limit: int | None = None

    _rv: int = attrs.field(default=0, init=False)
    _floor: int = attrs.field(default=0, init=False)  # all changes after this RV are in _log
    _log: list[_Change] = attrs.field(factory=list, init=False)
    _watches: list[_Watch] = attrs.field(factory=list, init=False)
    _waiters: list[asyncio.Future[None]] = attrs.field(factory=list, init=False)
    _arrivals: dict[kmock.Request, float] = attrs.field(factory=dict, init=False)
    _faults: list[kmock.Reaction] = attrs.field(factory=list, init=False)
    _closing: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _direct: dict[Any, kmock.Reaction] = attrs.field(factory=dict, init=False)
    _baseline_reactions: int = attrs.field(default=0, init=False)
    merge_keys: dict[kmock.resource, Mapping[tuple[str, ...], str]] = attrs.field(
        factory=lambda: {PODS: POD_MERGE_KEYS}, init=False
    )
    #: What issued tokens expire by (seconds since the epoch); replace it to expire them.
    wall_clock: Callable[[], float] = _unix_time
    _tokens: dict[str, IssuedToken] = attrs.field(factory=dict, init=False)
    _signing_key: bytes = attrs.field(factory=lambda: secrets.token_bytes(32), init=False)
    _subscribers: list[asyncio.Queue[StoreChange]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # kmock's discovery and LIST/WATCH/FETCH/... fallbacks
        self.fallback[kmock.method.PUT, kmock.resource()] << self._serve_replace
        # kmock matches a request against a reaction by scanning every request seen so far
        # (its slices need that), so each request costs O(requests) per reaction: thousands of
        # PATCHes take minutes. While no reaction has been added beyond these fallbacks, route
        # store requests straight to a reaction of their own (same rendering, no scan).
        self._direct = {
            kmock.action.LIST: self.fallback[kmock.action.LIST] << self._serve_list,
            kmock.action.WATCH: self.fallback[kmock.action.WATCH] << self._serve_watch,
            kmock.action.FETCH: self.fallback[kmock.action.FETCH] << self._serve_fetch,
            kmock.action.CREATE: self.fallback[kmock.action.CREATE] << self._serve_create,
            kmock.action.UPDATE: self.fallback[kmock.action.UPDATE] << self._serve_update,
            kmock.action.DELETE: self.fallback[kmock.action.DELETE] << self._serve_delete,
        }
        self._baseline_reactions = len(self._payloads)
        verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
        self.resources[PODS] = kmock.ResourceInfo(
            kind="Pod",
            singular="pod",
            namespaced=True,
            verbs=verbs,
            shortnames={"po"},
            subresources={"status"},
        )
        self.resources[EVENTS] = kmock.ResourceInfo(
            kind="Event", singular="event", namespaced=True, verbs=verbs, shortnames={"ev"}
        )
        self.resources[EVENTS_V1] = kmock.ResourceInfo(
            kind="Event", singular="event", namespaced=True, verbs=verbs, shortnames={"ev"}
        )
        self.resources[LEASES] = kmock.ResourceInfo(
            kind="Lease", singular="lease", namespaced=True, verbs=verbs
        )
        self.resources[TOKENREVIEWS] = kmock.ResourceInfo(
            kind="TokenReview", singular="", namespaced=False, verbs={"create"}
        )

    # ---- plumbing -----------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> Any:
        # Record the arrival, then dispatch: user reactions first, the fallbacks (the store)
        # last. Deliberately skips KubernetesEmulator._handle, which writes to the store before
        # the reactions run, so that a request answered by a fault changes nothing.
        self._arrivals[request] = asyncio.get_running_loop().time()
        self._wake_waiters()
        direct = self._direct.get(request.action) if request.resource is not None else None
        if (
            direct is not None
            and request.method != kmock.method.PUT
            and len(self._payloads) == self._baseline_reactions
        ):
            return await direct(request)
        return await kmock.RawHandler._handle(self, request)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        # kmock puts a server-side traceback into `details` when there are none; the API server
        # does not, and a test that compares Status bodies should not see one.
        if isinstance(exc, kmock.KubernetesError):
            reason = exc.reason or _REASONS.get(exc.status, "InternalError")
            body = status_body(exc.status, reason, exc.message or reason, exc.details or None)
            return aiohttp.web.json_response(body, status=exc.status)
        return await super()._render_error(exc)

    async def close(self) -> None:
        """End open watches and pending delays so that the server can stop at once."""
        self._closing.set()
        self.drop_watches()
        try:
            await self.wait_for_watches(0, exactly=True, within=2.0)
        except AssertionError:  # a stream stuck writing to a client that is gone
            self._watches.clear()  # the server's shutdown cancels its handler

    def client_configuration(self) -> kubernetes.client.Configuration:
        """A configuration for the official client, pointing at this emulator (no auth)."""
        return kubernetes.client.Configuration(host=str(self.url).rstrip("/"))

    def write_kubeconfig(
        self, path: str | pathlib.Path, namespace: str = "default"
    ) -> pathlib.Path:
        """Write a kubeconfig (JSON is YAML) with one context pointing at this emulator."""
        path = pathlib.Path(path)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": str(self.url).rstrip("/")}}],
            "users": [{"name": "kmock", "user": {}}],
            "contexts": [
                {
                    "name": "kmock",
                    "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace},
                }
            ],
            "current-context": "kmock",
        }
        path.write_text(json.dumps(config, indent=2))
        return path

    def _info(self, request: kmock.Request) -> tuple[kmock.resource, kmock.ResourceInfo]:
        resource = request.resource
        if resource is None or resource not in self.resources:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return resource, self.resources[resource]

    def _kind(self, resource: kmock.resource) -> str:
        # NB: kmock's ResourcesArray creates an entry on a missing key, hence `in` first.
        info = self.resources[resource] if resource in self.resources else None  # noqa: SIM401
        return info.kind if info is not None and info.kind else resource.plural.capitalize()

    def _key(self, resource: kmock.resource, namespace: str | None, name: str) -> Any:
        return (resource, namespace, name)

    # ---- the store -------------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        """The current (latest) resourceVersion, as a list would report it."""
        return str(self._rv)

    def get_object(
        self, resource: str | kmock.resource, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        """A copy of an object's current state, or None."""
        key = self._key(_as_resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def list_objects(
        self, resource: str | kmock.resource, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        """Copies of the current objects of a resource (sorted by namespace and name)."""
        resource = _as_resource(resource)
        found = [
            (key, obj)
            for key, obj in self.objects.items()
            if key[0] == resource and not obj.deleted and (namespace is None or key[1] == namespace)
        ]
        found.sort(key=lambda item: (item[0][1] or "", item[0][2]))
        return [copy.deepcopy(obj.raw) for _, obj in found]

    def peek_objects(
        self, resource: str | kmock.resource, namespace: str | None = None
    ) -> list[Mapping[str, Any]]:
        """The current objects of a resource as stored, not copied (in no order): a fast read
        for in-process controllers (testsupport/kube/endpoints.py). Read them, never change them."""
        resource = _as_resource(resource)
        return [
            obj.raw
            for key, obj in self.objects.items()
            if key[0] == resource and not obj.deleted and (namespace is None or key[1] == namespace)
        ]

    def put_object(self, resource: str | kmock.resource, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace an object directly in the store (no HTTP, no preconditions)."""
        resource = _as_resource(resource)
        new = copy.deepcopy(dict(obj))
        metadata = new.setdefault("metadata", {})
        metadata.pop("resourceVersion", None)  # unconditional, whatever version it was read at
        namespace, name = metadata.get("namespace"), metadata["name"]
        current = self.get_object(resource, namespace, name)
        if current is None:
            return self._create(resource, new)
        return self._update(resource, current, new, subresource=None, replace_status=True)

    def patch_object(
        self,
        resource: str | kmock.resource,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
    ) -> dict[str, Any]:
        """JSON-merge-patch an object directly in the store (spec and status alike)."""
        resource = _as_resource(resource)
        current = self.get_object(resource, namespace, name)
        if current is None:
            raise KeyError((resource, namespace, name))
        new = json_merge_patch(current, patch)
        return self._update(resource, current, new, subresource=None, replace_status=True)

    def delete_object(
        self, resource: str | kmock.resource, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        """Delete an object directly in the store; its last state, or None if there was none."""
        resource = _as_resource(resource)
        current = self.get_object(resource, namespace, name)
        if current is None:
            return None
        return self._commit(resource, "DELETED", current, current)

    def compact(self) -> None:
        """Forget the change history, as etcd compaction does: older watches get 410 Expired."""
        self._floor = self._rv
        self._log.clear()

    def _create(self, resource: kmock.resource, obj: dict[str, Any]) -> dict[str, Any]:
        metadata = obj.setdefault("metadata", {})
        metadata.pop("resourceVersion", None)
        metadata.setdefault("uid", str(uuid.uuid4()))
        metadata.setdefault("creationTimestamp", _now())
        obj["apiVersion"] = api_version_of(resource)
        obj["kind"] = self._kind(resource)
        return self._commit(resource, "ADDED", obj, None)

    def _update(
        self,
        resource: kmock.resource,
        current: dict[str, Any],
        new: dict[str, Any],
        *,
        subresource: str | None,
        replace_status: bool = False,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        metadata = new.setdefault("metadata", {})
        old_metadata = current["metadata"]
        requested = metadata.get("resourceVersion")
        if requested and requested != old_metadata.get("resourceVersion"):
            raise _conflict(resource, old_metadata["name"])
        for immutable in ("name", "namespace", "uid", "creationTimestamp"):
            if immutable in old_metadata:
                metadata[immutable] = old_metadata[immutable]
        metadata["resourceVersion"] = old_metadata.get("resourceVersion")
        new["apiVersion"] = api_version_of(resource)
        new["kind"] = self._kind(resource)
        has_status = (
            resource in self.resources and "status" in self.resources[resource].subresources
        )
        if has_status and not replace_status:
            # The main resource cannot change status; the status subresource only changes status
            # (and, for pods, metadata except ownerReferences: the pod status strategy).
            kept = ("spec",) if subresource == "status" else ("status",)
            for part in kept:
                if part in current:
                    new[part] = copy.deepcopy(current[part])
                else:
                    new.pop(part, None)
            if subresource == "status" and "ownerReferences" in old_metadata:
                metadata["ownerReferences"] = copy.deepcopy(old_metadata["ownerReferences"])
        if new == current or dry_run:
            return new  # a no-op write keeps the resourceVersion and emits nothing
        return self._commit(resource, "MODIFIED", new, current)

    def _commit(
        self,
        resource: kmock.resource,
        kind: str,
        obj: dict[str, Any],
        prev: dict[str, Any] | None,
    ) -> dict[str, Any]:
        self._rv += 1
        state = copy.deepcopy(obj)
        state.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        metadata = state["metadata"]
        key = self._key(resource, metadata.get("namespace"), metadata["name"])
        if kind == "DELETED":
            self.objects[key].delete()
        elif key not in self.objects:
            self.objects[key] = copy.deepcopy(state)
        else:
            self.objects[key].history.append(copy.deepcopy(state))
        change = _Change(self._rv, resource, kind, state, copy.deepcopy(prev))
        self._log.append(change)
        if self.history_limit is not None and len(self._log) > self.history_limit:
            dropped = self._log[: len(self._log) - self.history_limit]
            del self._log[: len(dropped)]
            self._floor = dropped[-1].rv
        for watch in self._watches:
            watch.queue.put_nowait(change)
        for subscriber in self._subscribers:
            subscriber.put_nowait(change)
        self._wake_waiters()
        return copy.deepcopy(state)

    # ---- HTTP handlers (kmock fallbacks: they run only if no reaction answered) -------------

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        resource, _ = self._info(request)
        assert request.name is not None
        if request.subresource not in (None, "status"):
            raise _not_found(resource, request.name)
        current = self.get_object(resource, request.namespace, request.name)
        if current is None:
            raise _not_found(resource, request.name)
        return kmock.Response(status=200, payload=current)

    async def _serve_list(self, request: kmock.Request) -> Any:
        if request.resource is not None and not request.resource.plural:
            # `/api/v1/` and `/apis/group/version/` (the client's discovery URLs, with a slash
            # that kmock's discovery patterns do not expect): serve kmock's discovery.
            version = kmock.resource(group=request.resource.group, version=request.resource.version)
            discovery = await self._serve_version(attrs.evolve(request, resource=version))
            return kmock.Response(status=200, payload=discovery)
        resource, _ = self._info(request)
        try:
            labels = parse_label_selector(request.params.get("labelSelector"))
            fields = parse_field_selector(
                request.params.get("fieldSelector"), self._fields_of(resource)
            )
        except SelectorError as error:
            raise _bad_request(str(error)) from None
        requested = request.params.get("resourceVersion", "")
        if requested not in ("", "0") and _as_int(requested) > self._rv:
            raise api_error(
                504, "Timeout", f"Too large resource version: {requested}, current: {self._rv}"
            )
        matcher = _Watch(resource, request.namespace, labels, fields, False, request)
        items = [
            obj for obj in self.list_objects(resource, request.namespace) if matcher.matches(obj)
        ]
        list_rv, offset = self._rv, 0
        if token := request.params.get("continue"):
            list_rv, offset = _decode_continue(token)
            if list_rv < self._floor:
                raise api_error(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a"
                    " consistent list result. You can start a new list without the continue"
                    " parameter.",
                )
        metadata: dict[str, Any] = {"resourceVersion": str(list_rv)}
        limit = _as_int(request.params.get("limit", "0"))
        if limit > 0:
            page = items[offset : offset + limit]
            if offset + limit < len(items):
                metadata["continue"] = _encode_continue(list_rv, offset + limit)
                metadata["remainingItemCount"] = len(items) - offset - limit
            items = page
        else:
            items = items[offset:]
        for item in items:  # items in a list carry no kind/apiVersion of their own
            item.pop("kind", None)
            item.pop("apiVersion", None)
        body = {
            "apiVersion": api_version_of(resource),
            "kind": f"{self._kind(resource)}List",
            "metadata": metadata,
            "items": items,
        }
        return kmock.Response(status=200, payload=body)

    async def _serve_create(self, request: kmock.Request) -> Any:
        resource, info = self._info(request)
        if resource == TOKENREVIEWS:
            return self._serve_token_review(request)
        if request.name is not None or not isinstance(request.data, Mapping):
            raise _bad_request("the body of the request must be an object")
        obj = copy.deepcopy(dict(request.data))
        metadata = obj.setdefault("metadata", {})
        if info.namespaced:
            if metadata.get("namespace") and metadata["namespace"] != request.namespace:
                raise _bad_request(
                    "the namespace of the provided object does not match the namespace sent on"
                    " the request"
                )
            metadata["namespace"] = request.namespace
        if not metadata.get("name"):
            if not metadata.get("generateName"):
                raise api_error(
                    422,
                    "Invalid",
                    f"{self._kind(resource)} is invalid: metadata.name: Required value: name or"
                    " generateName is required",
                )
            metadata["name"] = metadata["generateName"] + secrets.token_hex(3)[:5]
        if self.get_object(resource, metadata.get("namespace"), metadata["name"]) is not None:
            raise api_error(
                409,
                "AlreadyExists",
                f'{_resource_label(resource)} "{metadata["name"]}" already exists',
                **_details(resource, metadata["name"]),
            )
        if request.params.get("dryRun"):
            return kmock.Response(status=201, payload=obj)
        return kmock.Response(status=201, payload=self._create(resource, obj))

    async def _serve_update(self, request: kmock.Request) -> Any:  # PATCH
        resource, _ = self._info(request)
        current = self._current_for_write(request, resource)
        content_type = (_header(request.headers, "Content-Type") or "").split(";")[0].strip()
        patch = request.data
        try:
            if content_type == "application/merge-patch+json" and isinstance(patch, Mapping):
                new = json_merge_patch(current, patch)
            elif content_type == "application/strategic-merge-patch+json" and isinstance(
                patch, Mapping
            ):
                keys = self.merge_keys.get(resource, METADATA_MERGE_KEYS)
                new = strategic_merge_patch(current, patch, keys)
            elif content_type == "application/json-patch+json" and isinstance(patch, list):
                new = jsonpatch.apply_patch(copy.deepcopy(current), patch)
            elif content_type.startswith("application/apply-patch"):
                raise api_error(415, "UnsupportedMediaType", "server-side apply is not emulated")
            else:
                raise _bad_request(f"cannot apply a {content_type!r} patch of {patch!r}")
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
            raise api_error(422, "Invalid", f"the patch cannot be applied: {error}") from None
        if not isinstance(new, dict):
            raise api_error(422, "Invalid", "the patched object is not an object")
        result = self._update(
            resource,
            current,
            new,
            subresource=request.subresource,
            dry_run=bool(request.params.get("dryRun")),
        )
        return kmock.Response(status=200, payload=result)

    async def _serve_replace(self, request: kmock.Request) -> Any:  # PUT
        resource, _ = self._info(request)
        current = self._current_for_write(request, resource)
        if not isinstance(request.data, Mapping):
            raise _bad_request("the body of the request must be an object")
        new = copy.deepcopy(dict(request.data))
        body_name = new.get("metadata", {}).get("name")
        if body_name != request.name:
            raise _bad_request(
                f"the name of the object ({body_name}) does not match the name on the URL"
                f" ({request.name})"
            )
        result = self._update(
            resource,
            current,
            new,
            subresource=request.subresource,
            dry_run=bool(request.params.get("dryRun")),
        )
        return kmock.Response(status=200, payload=result)

    async def _serve_delete(self, request: kmock.Request) -> Any:
        resource, _ = self._info(request)
        current = self._current_for_write(request, resource)
        preconditions = (request.data or {}).get("preconditions") or {}
        for key in ("resourceVersion", "uid"):
            wanted = preconditions.get(key)
            if wanted and wanted != current["metadata"].get(key):
                raise _conflict(resource, current["metadata"]["name"])
        if request.params.get("dryRun"):
            return kmock.Response(status=200, payload=current)
        return kmock.Response(
            status=200, payload=self._commit(resource, "DELETED", current, current)
        )

    def _current_for_write(self, request: kmock.Request, resource: kmock.resource) -> dict:
        assert request.name is not None
        if request.subresource is not None and (
            request.subresource not in self.resources[resource].subresources
        ):
            raise _not_found(resource, request.name)
        current = self.get_object(resource, request.namespace, request.name)
        if current is None:
            raise _not_found(resource, request.name)
        return current

    def _fields_of(self, resource: kmock.resource) -> tuple[str, ...]:
        if resource == PODS:
            return POD_FIELDS
        if resource == EVENTS:
            return EVENT_FIELDS
        return ()

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        resource, _ = self._info(request)
        try:
            labels = parse_label_selector(request.params.get("labelSelector"))
            fields = parse_field_selector(
                request.params.get("fieldSelector"), self._fields_of(resource)
            )
        except SelectorError as error:
            raise _bad_request(str(error)) from None
        if request.name is not None:  # the deprecated watch of one object by its URL
            fields = (*fields, FieldRequirement("metadata.name", request.name))
        requested = request.params.get("resourceVersion", "")
        bookmarks = request.params.get("allowWatchBookmarks") in ("true", "1")
        timeout = request.params.get("timeoutSeconds")
        watch = _Watch(resource, request.namespace, labels, fields, bookmarks, request)

        # Decide what to replay and subscribe in one synchronous step: no change can slip
        # between the replay and the subscription.
        initial: list[dict[str, Any]] = []
        if requested in ("", "0"):
            for obj in self.list_objects(resource, request.namespace):
                if watch.matches(obj):
                    initial.append({"type": "ADDED", "object": obj})
            if request.params.get("sendInitialEvents") == "true" and bookmarks:
                bookmark = self._bookmark(resource)
                bookmark["object"]["metadata"]["annotations"] = {
                    "k8s.io/initial-events-end": "true"
                }
                initial.append(bookmark)
        elif _as_int(requested) < self._floor:
            message = f"too old resource version: {requested} ({self._floor})"
            yield b""
            yield {"type": "ERROR", "object": status_body(410, "Expired", message)}
            return
        else:
            since = _as_int(requested)
            for change in self._log:
                if change.rv > since and (event := watch.event_for(change)) is not None:
                    initial.append(event)
        self._watches.append(watch)
        self._wake_waiters()
        try:
            yield b""  # send the headers now, as the API server does
            for event in initial:
                yield event
            loop = asyncio.get_running_loop()
            deadline = loop.time() + float(timeout) if timeout else None
            while True:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    item = await asyncio.wait_for(watch.queue.get(), remaining)
                except TimeoutError:
                    if bookmarks:
                        yield self._bookmark(resource)
                    return
                if item is _DROP:
                    return
                if item is _ABORT:
                    raw = request._raw_request
                    if raw is not None and raw.transport is not None:
                        raw.transport.abort()
                    return
                if isinstance(item, _Bookmark):
                    if bookmarks:
                        yield self._bookmark(resource, item.rv)
                    continue
                if (event := watch.event_for(item)) is not None:
                    yield event
        finally:
            if watch in self._watches:
                self._watches.remove(watch)
            self._wake_waiters()

    def _bookmark(self, resource: kmock.resource, rv: int | None = None) -> dict[str, Any]:
        return {
            "type": "BOOKMARK",
            "object": {
                "kind": self._kind(resource),
                "apiVersion": api_version_of(resource),
                "metadata": {"resourceVersion": str(self._rv if rv is None else rv)},
            },
        }

    # ---- in-process subscribers (testsupport/kube/kubelet.py, testsupport/kube/endpoints.py) ----

    def subscribe(self) -> asyncio.Queue[StoreChange]:
        """Every change committed from now on, in order, as :class:`StoreChange` items: an
        in-process informer for test-side controllers (the kubelet, the EndpointSlice
        controller). Not a watch: no HTTP, not in ``watch_count``, not ended by
        ``drop_watches`` or ``close``; ``unsubscribe`` when done. The items share the store's
        copies: read them, never change them."""
        queue: asyncio.Queue[StoreChange] = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[StoreChange]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(queue)

    # ---- watches -----------------------------------------------------------------------------

    @property
    def watch_count(self) -> int:
        """How many watch streams are open now."""
        return len(self._watches)

    def watch_requests(self) -> list[kmock.Request]:
        """The requests of the open watch streams (e.g. to check their ``resourceVersion``)."""
        return [watch.request for watch in self._watches]

    async def wait_for_watches(
        self, count: int = 1, *, exactly: bool = False, within: float = 5.0
    ) -> None:
        """Wait until at least (or exactly) ``count`` watch streams are open."""
        if exactly:
            await self.wait_until(lambda: len(self._watches) == count, within=within)
        else:
            await self.wait_until(lambda: len(self._watches) >= count, within=within)

    async def wait_until(self, predicate: Callable[[], Any], *, within: float = 30.0) -> Any:
        """Wait until ``predicate()`` is truthy and return its value (AssertionError after
        ``within`` seconds). No polling: the predicate is checked again whenever a request
        arrives, the store changes, or a watch opens or closes, so it must depend on the
        emulator only, e.g. ``lambda: len(kube.requests("PATCH")) >= 3`` or
        ``lambda: kube.pod_labels("ray", "a").get("ray.io/serve") == "false"``. For the
        product's own state, poll with ``testsupport.waiting.eventually``.
        """
        try:
            async with asyncio.timeout(within):
                while not (value := predicate()):
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiters.append(waiter)
                    await waiter
        except TimeoutError:
            raise AssertionError(f"not met within {within}s: {predicate}") from None
        return value

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def drop_watches(self, *, abrupt: bool = False) -> int:
        """End every open watch stream; return how many there were.

        ``abrupt=False``: the stream ends cleanly, as when the API server ends a watch (timeout,
        restart): the official client's ``Watch.stream`` re-watches from the last resourceVersion
        it saw (unless it was given ``timeout_seconds``). ``abrupt=True``: the TCP connection is
        cut mid-stream, as by a dying proxy: the client raises
        ``urllib3.exceptions.ProtocolError``. There is no kmock DSL for this: watch streams are
        served by the emulator, not by a reaction. To make *new* watches fail instead, use the
        DSL: ``kube.fail_next(1, status=500, verb="watch")``.
        """
        for watch in self._watches:
            watch.queue.put_nowait(_ABORT if abrupt else _DROP)
        return len(self._watches)

    def bookmark(self) -> int:
        """Send a BOOKMARK (current resourceVersion) to open watches that allow bookmarks."""
        for watch in self._watches:
            watch.queue.put_nowait(_Bookmark(self._rv))
        return sum(1 for watch in self._watches if watch.bookmarks)

    # ---- ServiceAccount tokens and TokenReview -------------------------------------------------

    def issue_token(
        self,
        namespace: str,
        service_account: str,
        *,
        pod: str | None = None,
        node: str | None = None,
        audiences: Sequence[str] = ("ray-serve-health",),
        expires_in: float = 3600.0,
    ) -> str:
        """A projected ServiceAccount token (what the kubelet writes in a ``serviceAccountToken``
        volume, or ``kubectl create token``), which TokenReview then vouches for.

        ``pod``: bound to that pod of ``namespace``, which must exist; the token names its uid
        and, once scheduled, its node (as Kubernetes 1.30+ does). ``node``: bound to a node
        instead (no pod). ``expires_in`` is counted from ``wall_clock()`` (negative: already
        expired); ``exp`` is whole seconds.
        """
        now = self.wall_clock()
        pod_uid = node_name = None
        if pod is not None:
            stored = self.pod(namespace, pod)
            if stored is None:
                raise KeyError(f"cannot bind a token to pod {namespace}/{pod}: no such pod")
            bound_account = (stored.get("spec") or {}).get("serviceAccountName")
            if bound_account and bound_account != service_account:
                raise ValueError(
                    f"cannot bind a token for serviceaccount {service_account} to pod {pod} "
                    f"running with serviceaccount {bound_account}"
                )
            pod_uid = stored["metadata"]["uid"]
            node_name = (stored.get("spec") or {}).get("nodeName") or None
            if node is not None:
                raise ValueError("a token is bound to a pod or to a node, not both")
        elif node is not None:
            node_name = node
        issued = IssuedToken(
            namespace=namespace,
            service_account=service_account,
            audiences=tuple(audiences),
            issued_at=int(now),
            expires_at=int(now + expires_in),
            jti=str(uuid.uuid4()),
            pod_name=pod,
            pod_uid=pod_uid,
            node_name=node_name,
            node_uid=node_uid(node_name) if node_name else None,
        )
        header = _b64url(
            json.dumps({"alg": "RS256", "kid": "kmock"}, separators=(",", ":")).encode()
        )
        payload = _b64url(json.dumps(issued.claims(), separators=(",", ":")).encode())
        signed = f"{header}.{payload}".encode()
        signature = _b64url(hmac.new(self._signing_key, signed, hashlib.sha256).digest())
        token = f"{header}.{payload}.{signature}"
        self._tokens[token] = issued
        return token

    def issued(self, token: str) -> IssuedToken | None:
        """What the emulator issued as ``token`` (None: not one of its tokens)."""
        return self._tokens.get(token)

    def review(self, token: str, audiences: Sequence[str] = ()) -> dict[str, Any]:
        """The ``status`` a TokenReview of ``token`` for ``audiences`` answers (no HTTP)."""
        issued = self._tokens.get(token)
        if issued is None:
            return _review_failure("token lookup failed")
        if issued.expires_at <= self.wall_clock():
            return _review_failure("service account token has expired")
        wanted = list(audiences) or [API_AUDIENCE]
        common = [audience for audience in wanted if audience in issued.audiences]
        if not common:
            return _review_failure(
                f"token audiences {json.dumps(list(issued.audiences))} is invalid for the "
                f"target audiences {json.dumps(wanted)}"
            )
        if issued.pod_name is not None:
            pod = self.pod(issued.namespace, issued.pod_name)
            if pod is None or pod["metadata"].get("uid") != issued.pod_uid:
                return _review_failure("service account token has been invalidated")
        return {"authenticated": True, "audiences": common, "user": issued.user()}

    def _serve_token_review(self, request: kmock.Request) -> Any:
        body = request.data
        if not isinstance(body, Mapping):
            raise _bad_request("the body of the request must be a TokenReview")
        spec = body.get("spec") or {}
        token = spec.get("token") or ""
        if not token:
            raise _bad_request("token is required for TokenReview in authentication")
        review = {
            "kind": "TokenReview",
            "apiVersion": api_version_of(TOKENREVIEWS),
            "metadata": {"creationTimestamp": None},
            "spec": copy.deepcopy(dict(spec)),
            "status": self.review(token, spec.get("audiences") or ()),
        }
        return kmock.Response(status=201, payload=review)

    # ---- pods ----------------------------------------------------------------------------------

    def add_pod(
        self,
        namespace: str = "default",
        name: str = "ray-worker-0",
        *,
        labels: Mapping[str, str] | None = None,
        node_name: str | None = "node-1",
        pod_ip: str | None = None,
        serve_port: int | None = 8000,
        readiness_gates: Sequence[str] = (),
        phase: str = "Running",
        conditions: Sequence[Mapping[str, Any]] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Create (or replace) a pod in the store, as ``make_pod`` builds it; emits ADDED.
        Returns the stored pod, with its uid and resourceVersion."""
        pod = make_pod(
            namespace,
            name,
            labels=labels,
            node_name=node_name,
            pod_ip=pod_ip,
            serve_port=serve_port,
            readiness_gates=readiness_gates,
            phase=phase,
            conditions=conditions,
            annotations=annotations,
        )
        return self.put_object(PODS, pod)

    def add_ray_cluster(
        self, dashboard_port: int, worker: str = "raycluster-worker", **worker_settings: Any
    ) -> dict[str, Any]:
        """A Ray head at 127.0.0.1 whose container port ``dashboard`` is ``dashboard_port``,
        and a worker ``worker`` at 127.0.0.2 (nothing listens there), ``worker_settings`` as
        :meth:`add_pod` takes them; returns the stored worker."""
        head = make_pod(
            "default",
            "raycluster-head",
            labels={**DEFAULT_POD_LABELS, "ray.io/node-type": "head"},
            pod_ip="127.0.0.1",
        )
        head["spec"]["containers"][0]["ports"].append(
            {"name": "dashboard", "containerPort": dashboard_port, "protocol": "TCP"}
        )
        self.put_object(PODS, head)
        return self.add_pod("default", worker, pod_ip="127.0.0.2", **worker_settings)

    def modify_pod(
        self,
        namespace: str,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        node_name: str | None = None,
        pod_ip: str | None = None,
        phase: str | None = None,
        patch: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Change a pod in the store: merge ``labels`` (None removes one), set the node, IP,
        phase, then JSON-merge-patch ``patch``. Emits MODIFIED (unless nothing changed)."""
        changes: dict[str, Any] = {}  # a merge patch: None values stay, to remove keys
        if labels is not None:
            changes.setdefault("metadata", {})["labels"] = dict(labels)
        if node_name is not None:
            changes.setdefault("spec", {})["nodeName"] = node_name
        if pod_ip is not None:
            changes.setdefault("status", {}).update(podIP=pod_ip, podIPs=[{"ip": pod_ip}])
        if phase is not None:
            changes.setdefault("status", {})["phase"] = phase
        if patch is not None:
            changes = _combine_merge_patches(changes, patch)
        return self.patch_object(PODS, namespace, name, changes)

    def delete_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Delete a pod from the store (emits DELETED); its last state, or None."""
        return self.delete_object(PODS, namespace, name)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A copy of the pod as stored now, or None."""
        return self.get_object(PODS, namespace, name)

    def pod_labels(self, namespace: str, name: str) -> dict[str, str]:
        """The pod's current labels (KeyError if there is no such pod)."""
        pod = self.pod(namespace, name)
        if pod is None:
            raise KeyError((namespace, name))
        return dict(pod["metadata"].get("labels") or {})

    def pod_conditions(self, namespace: str, name: str) -> dict[str, dict[str, Any]]:
        """The pod's current ``status.conditions``, by type (KeyError if there is no such pod)."""
        pod = self.pod(namespace, name)
        if pod is None:
            raise KeyError((namespace, name))
        return {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Events created through ``v1`` and ``events.k8s.io/v1``, in creation order."""
        found = self.list_objects(EVENTS, namespace) + self.list_objects(EVENTS_V1, namespace)
        return sorted(found, key=lambda event: int(event["metadata"]["resourceVersion"]))

    def lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get_object(LEASES, namespace, name)

    # ---- request accounting ----------------------------------------------------------------

    def checkpoint(self) -> int:
        """A mark for ``requests(since=...)``: only requests that arrive after it."""
        return len(self._requests)

    def requests(
        self,
        method: str | None = None,
        *,
        verb: str | None = None,
        resource: str | kmock.resource | None = None,
        subresource: str | EllipsisType | None = ANY,
        namespace: str | None = None,
        name: str | None = None,
        since: int = 0,
    ) -> list[ApiCall]:
        """Requests that reached the emulator, oldest first, whatever answered them.

        ``requests("PATCH", resource="pods")`` counts patches of pods and of ``pods/status``;
        ``subresource=None`` keeps only the pods themselves, ``subresource="status"`` only the
        status. ``verb`` is the RBAC verb (``get``, ``list``, ``watch``, ``patch``, ...).
        """
        view: Any = self.select(
            method=method,
            verb=verb,
            resource=resource,
            subresource=subresource,
            namespace=namespace,
            name=name,
        )
        chosen = {id(request) for request in view}
        calls = []
        for request in self._requests[since:]:
            if id(request) not in chosen:
                continue
            calls.append(
                ApiCall(
                    method=str(request.method.value).upper(),
                    verb=_verb(request),
                    path=request.url.path,
                    resource=request.resource.plural if request.resource else None,
                    group=request.resource.group if request.resource else None,
                    subresource=request.subresource,
                    namespace=request.namespace,
                    name=request.name,
                    params=dict(request.params),
                    headers=dict(request.headers),
                    body=request.data,
                    at=self._arrivals.get(request, float("nan")),
                    request=request,
                )
            )
        return calls

    # ---- faults (kmock DSL) ----------------------------------------------------------------

    def select(
        self,
        *,
        method: str | None = None,
        verb: str | None = None,
        resource: str | kmock.resource | None = None,
        subresource: str | EllipsisType | None = ANY,
        namespace: str | None = None,
        name: str | None = None,
    ) -> Any:
        """A kmock view of the requests with these properties, to put reactions on.

        The same as kmock's DSL: ``select(method="PATCH", resource="v1/pods")`` is
        ``kube[kmock.method.PATCH, kmock.resource("v1/pods")]`` (or ``kube["patch pods.v1"]``);
        ``subresource=None`` adds ``kmock.subresource(None)``, ``namespace``/``name`` add
        ``kmock.namespace(...)``/``kmock.name(...)``, ``verb`` adds a callable criterion.
        """
        view: Any = self
        if method is not None:
            view = view[kmock.method(method.upper())]
        if resource is not None:
            view = view[_as_resource(resource)]
        if subresource is not ANY:
            view = view[kmock.subresource(subresource)]
        if namespace is not None:
            view = view[kmock.namespace(namespace)]
        if name is not None:
            view = view[kmock.name(name)]
        if verb is not None:
            view = view[lambda request: _verb(request) == verb]
        return view

    def fail_next(
        self,
        count: int,
        *,
        status: int = 500,
        retry_after: int | None = None,
        message: str | None = None,
        method: str | None = None,
        verb: str | None = None,
        resource: str | kmock.resource | None = "v1/pods",
        subresource: str | EllipsisType | None = ANY,
        namespace: str | None = None,
        name: str | None = None,
    ) -> kmock.Reaction:
        """Answer the next ``count`` matching requests with ``status`` (and a Status body).

        The request is not applied (the store is untouched), as with a real API server. The
        returned kmock reaction lists the requests it answered (``len(reaction)``). "Next" counts
        from this call: two overlapping faults installed together overlap, they do not queue.
        ``resource=None`` matches every resource. In kmock's own DSL this is::

            view = kube[kmock.method.PATCH, kmock.resource("v1/pods")]   # or kube.select(...)
            k = len(view)                       # requests seen so far: the slice is "the next N"
            view[k:k + count] << 429 << {"Retry-After": "1"} << status_body(429, ...)

        Mind the client: urllib3's default retry (the official client's default) repeats GET,
        PUT and DELETE answered 429/503 *with* ``Retry-After`` by itself, sleeping that long
        (up to 3 times), before the product sees anything. PATCH and POST are never retried.
        """
        view = self.select(
            method=method,
            verb=verb,
            resource=resource,
            subresource=subresource,
            namespace=namespace,
            name=name,
        )
        start = len(view)
        reason = _REASONS.get(status, "InternalError")
        details: dict[str, Any] = {}
        headers: dict[str, str] = {}
        if retry_after is not None:
            headers["Retry-After"] = str(int(retry_after))  # whole seconds, as urllib3 parses it
            details["retryAfterSeconds"] = int(retry_after)
        body = status_body(status, reason, message or f"injected fault: {reason}", details)
        reaction = view[start : start + count] << status
        if headers:
            reaction = reaction << headers
        reaction = reaction << body
        self._faults.append(reaction)
        return reaction

    def throttle_patches(self, count: int, *, retry_after: int = 1) -> kmock.Reaction:
        """The next ``count`` PATCHes of pods (or pods/status) answer 429 with Retry-After.

        Shortcut for ``fail_next(count, status=429, retry_after=retry_after, method="PATCH")``.
        """
        return self.fail_next(count, status=429, retry_after=retry_after, method="PATCH")

    def pod_not_found(self, namespace: str, name: str) -> kmock.Reaction:
        """Every request for this pod (and its subresources) answers 404, until ``clear_faults``.

        The pod may still be in the store (e.g. deleted and re-created behind the client's
        back). In kmock's DSL::

            kube[kmock.resource("v1/pods"), kmock.namespace(ns), kmock.name(name)] << 404 << body
        """
        view = self.select(resource=PODS, namespace=namespace, name=name)
        body = status_body(404, "NotFound", f'pods "{name}" not found', _details(PODS, name))
        reaction = view << 404 << body
        self._faults.append(reaction)
        return reaction

    def slow(self, seconds: float | Callable[[], float] = 2.0, where: Any = None) -> kmock.Reaction:
        """Delay every request (or those of the kmock view ``where``) by ``seconds``, then answer
        it as usual (faults included). Ends when the emulator closes or on ``clear_faults``.

        ``seconds`` may be a function: called once per request, it draws that request's delay,
        so the API answers with a latency distribution (``bench/failover.py --api-latency``:
        most requests in tens of milliseconds, 1 % in seconds). Requests are delayed
        concurrently, each by its own draw. A request whose client gives up during its delay
        (a timeout) is never applied: kmock serves through aiohttp's test server, which cancels
        a request's handler when its connection closes. So does the API server with a request
        waiting in a priority-and-fairness queue; a write that reached etcd before its client
        left, which the API server would still commit, is not modelled.

        kmock has no pass-through delay as such: a reaction that only sleeps and returns nothing
        is taken for a mismatch and disabled after one request. Raising ``NotImplementedError``
        means "matched, nothing to answer" and passes the request on. In kmock's DSL::

            async def delay(request):
                await asyncio.sleep(seconds)
                raise NotImplementedError  # kmock: on to the next reaction
            (where or kube).override << delay
        """

        draw = seconds if callable(seconds) else lambda: seconds

        async def delay(request: kmock.Request) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), draw())
            raise NotImplementedError

        view = where if where is not None else self
        reaction = view.override << delay
        self._faults.append(reaction)
        return reaction

    def clear_faults(self) -> None:
        """Remove every reaction added by the fault helpers."""
        faults = {id(reaction) for reaction in self._faults}
        self._payloads[:] = [p for p in self._payloads if id(p) not in faults]
        self._faults.clear()


def _review_failure(reason: str) -> dict[str, Any]:
    """The status of a TokenReview that did not authenticate (``authenticated`` is omitted when
    false, as in the API server's JSON)."""
    return {"user": {}, "error": f"[invalid bearer token, {reason}]"}


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _as_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _bad_request(f"invalid resource version or limit: {text!r}") from None


def _encode_continue(list_rv: int, offset: int) -> str:
    raw = json.dumps({"rv": list_rv, "start": offset}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_continue(token: str) -> tuple[int, int]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), int(data["start"])
    except (ValueError, KeyError, TypeError):
        raise _bad_request("invalid continue token") from None
