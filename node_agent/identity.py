"""Who the agent reports for, from the Kubernetes downward API.

A sidecar needs its pod's namespace, name and uid and its node (:class:`SidecarPod`); a DaemonSet
agent only its node (:func:`node_name_from_environ`), as it learns its pods from the API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
        return cls(
            environ["POD_NAMESPACE"], environ["POD_NAME"], environ["POD_UID"], environ["NODE_NAME"]
        )

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def node_name_from_environ(environ: Mapping[str, str]) -> str:
    """The node a DaemonSet agent runs on (``NODE_NAME``)."""
    require(environ, NODE_REQUIRED)
    return environ["NODE_NAME"]
