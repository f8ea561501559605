"""Who the agent reports for, from the Kubernetes downward API.

A sidecar needs its pod's namespace, name and uid and its node (:class:`SidecarPod`); a DaemonSet
agent only its node (:func:`node_name_from_environ`), as it learns its pods from the API.

A sidecar's namespace and pod name are checked here by the aggregator's own rules
(``servehealth_common.pod_identity``): a name it could never accept ends the agent at start
(exit 2) rather than being refused by the aggregator at every reconnection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from servehealth_common.pod_identity import DNS_LABEL, DNS_SUBDOMAIN

#: What a sidecar needs, in this order.
REQUIRED = ("POD_NAMESPACE", "POD_NAME", "POD_UID", "NODE_NAME")
#: What a DaemonSet agent needs.
NODE_REQUIRED = ("NODE_NAME",)
#: The downward-API ``fieldRef`` of each variable.
FIELD_PATHS = {
    "POD_NAMESPACE": "metadata.namespace",
    "POD_NAME": "metadata.name",
    "POD_UID": "metadata.uid",
    "NODE_NAME": "spec.nodeName",
}


class MissingIdentity(ValueError):
    pass


class InvalidIdentity(ValueError):
    """A downward-API value no aggregator would accept (the process exits 2)."""


def check_pod(namespace: str, name: str) -> None:
    """Raise InvalidIdentity unless ``namespace`` is an RFC 1123 label and ``name`` an RFC 1123
    subdomain (what Kubernetes allows, and what the aggregator checks a hello against)."""
    if not DNS_LABEL.fullmatch(namespace):
        raise InvalidIdentity(
            f"POD_NAMESPACE {namespace[:80]!r} is not a valid namespace (an RFC 1123 label: at "
            "most 63 lower-case letters, digits and '-'): set it from the downward API "
            f"(fieldRef {FIELD_PATHS['POD_NAMESPACE']})"
        )
    if not DNS_SUBDOMAIN.fullmatch(name):
        raise InvalidIdentity(
            f"POD_NAME {name[:80]!r} is not a valid pod name (an RFC 1123 subdomain: at most 253 "
            "lower-case letters, digits, '-' and '.'): set it from the downward API "
            f"(fieldRef {FIELD_PATHS['POD_NAME']})"
        )


def require(environ: Mapping[str, str], names: Sequence[str]) -> None:
    """Raise MissingIdentity naming exactly the variables of ``names`` that are unset or empty."""
    missing = [name for name in names if not environ.get(name)]
    if missing:
        plural = len(missing) > 1
        raise MissingIdentity(
            f"environment variable{'s' if plural else ''} {', '.join(missing)} "
            f"not set: expose {'them' if plural else 'it'} to the agent "
            "container with the downward API (fieldRef "
            f"{', '.join(FIELD_PATHS[name] for name in names)})"
        )


@dataclass(frozen=True, slots=True)
class SidecarPod:
    namespace: str
    name: str
    uid: str
    node_name: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SidecarPod:
        require(environ, REQUIRED)
        check_pod(environ["POD_NAMESPACE"], environ["POD_NAME"])
        return cls(*(environ[name] for name in REQUIRED))  # REQUIRED is in field order

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def node_name_from_environ(environ: Mapping[str, str]) -> str:
    """The node a DaemonSet agent runs on (``NODE_NAME``)."""
    require(environ, NODE_REQUIRED)
    return environ["NODE_NAME"]
