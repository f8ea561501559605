"""Which pod a thing is about: the identity types both programs share.

:class:`PodKey` names a pod (namespace and name); :class:`PodInfo` adds what is known of the
pod object itself (uid, node, address and Serve port). Every module that speaks of a pod uses
these two, and no other type means the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

#: Kubernetes: namespaces are RFC 1123 labels, pod names RFC 1123 subdomains. Use with
#: ``fullmatch``. The aggregator checks a hello against them, and a sidecar its own pod at start
#: (one rule: a name the aggregator would refuse stops the agent instead).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)


class PodKey(NamedTuple):
    """A pod's namespace and name: unique among live pods, reused by a replacement pod."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class PodInfo:
    """A pod as its registry knows it: the uid tells a replacement pod of the same name apart;
    the address and ports are where its Serve proxies can be probed (unknown in memory mode;
    ``grpc_port`` 0: no gRPC ingress declared)."""

    key: PodKey
    uid: str = ""
    node_name: str = ""
    pod_ip: str = ""
    serve_port: int = 0
    grpc_port: int = 0
