"""Who may open a Report stream and report for which pod: the rules, with no gRPC in them.

Each rule returns an :class:`Outcome`; the servicer maps a refusal to its gRPC status
(:data:`aggregator.ingest.report_service.STATUS_OF`), and a skipped report is counted, not refused.

- **Streams per client address** (``--max-streams-per-peer``): more are refused.
- **Unknown pod**: a sidecar's pod must be known to the registry (refused otherwise: the agent
  retries); a DaemonSet agent may name a pod before the aggregator discovers it, or one outside
  its selector: that report is skipped, the stream goes on.
- **Node binding** (``--auth tokenreview``): a DaemonSet agent reports only for pods on its
  token's node (another node: refused; a pod not scheduled yet: skipped).
- **Pods per stream** (``--max-pods-per-stream``): the report naming one more is refused.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from aggregator.auth import AuthError, PermissionDenied, check_pod_node
from servehealth_common.pod_identity import PodInfo, PodKey


class Refusal(enum.Enum):
    """Why a stream is ended; each maps to one gRPC status in the servicer."""

    INVALID = "invalid"  # a message that breaks the contract
    NO_HELLO = "no_hello"  # the hello did not come in time
    UNKNOWN_POD = "unknown_pod"  # a sidecar for a pod the registry does not know
    WRONG_NODE = "wrong_node"  # a DaemonSet agent for a pod on another node
    TOO_MANY_STREAMS = "too_many_streams"
    TOO_MANY_PODS = "too_many_pods"
    TOO_FAST = "too_fast"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a rule says: go on (the default), skip this one report (``skip`` names why, for
    ``serve_health_reports_ignored``), or end the stream (``refusal``, with a message for
    the agent and, for an authorization refusal, the error the guard logs)."""

    refusal: Refusal | None = None
    message: str = ""
    skip: str = ""
    cause: AuthError | None = None

    @property
    def admitted(self) -> bool:
        return self.refusal is None and not self.skip


ADMITTED = Outcome()


def refused(refusal: Refusal, message: str, cause: AuthError | None = None) -> Outcome:
    return Outcome(refusal, message, cause=cause)


def peer_host(peer: str) -> str:
    """The client address without its port: ``"ipv4:10.1.2.3:5000"`` -> ``"10.1.2.3"``.

    ``"ipv6:[::1]:5000"`` -> ``"::1"``; an IPv4-mapped address counts as its IPv4 one; anything
    else (``unix:...``) is kept whole.
    """
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return peer
    host = rest.rpartition(":")[0].strip("[]")
    return host.removeprefix("::ffff:")


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    max_streams_per_peer: int = 64
    max_pods_per_stream: int = 512


class StreamsPerPeer:
    """Open Report streams by client address (without its port)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._open: collections.Counter[str] = collections.Counter()

    def open(self, host: str) -> Outcome:
        """Count a new stream of ``host``, or refuse it (then :meth:`close` is not called)."""
        count = self._open[host]
        if count >= self._limit:
            return refused(
                Refusal.TOO_MANY_STREAMS,
                f"too many report streams from {host}: {count} are open "
                f"(--max-streams-per-peer {self._limit})",
            )
        self._open[host] += 1
        return ADMITTED

    def close(self, host: str) -> None:
        self._open[host] -= 1
        if not self._open[host]:
            del self._open[host]


def unknown_pod(sidecar: bool, why: str) -> Outcome:
    """A pod the registry does not know: a sidecar is refused, a DaemonSet's report skipped."""
    if sidecar:
        return refused(Refusal.UNKNOWN_POD, why)
    return Outcome(skip="unknown_pod", message=why)


def new_pod_on_stream(
    key: PodKey,
    pods_on_stream: int,
    max_pods: int,
    node: str | None,
    pod: PodInfo | None,
) -> Outcome:
    """A stream names ``key`` for the first time, with ``pods_on_stream`` pods so far.

    ``node``: the node a DaemonSet agent's token binds it to (None: no binding); ``pod``: what
    the registry knows of the pod (its node).
    """
    if node is not None:
        try:
            scheduled = check_pod_node(node, str(key), pod.node_name if pod is not None else None)
        except PermissionDenied as error:
            return refused(Refusal.WRONG_NODE, str(error), error)
        if not scheduled:
            return Outcome(skip="pod_unscheduled")
    if pods_on_stream >= max_pods:
        why = f"this stream reports for more than {max_pods} pods (--max-pods-per-stream)"
        return refused(Refusal.TOO_MANY_PODS, why)
    return ADMITTED
