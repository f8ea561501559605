"""Messages of ``servehealth.v1`` to and from the core's types, with input validation.

Everything an agent sends is checked here; a violation raises :class:`InvalidMessage`, whose
text is what the agent reads in its INVALID_ARGUMENT status.
"""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from aggregator.decision.tracker import Observation, PodRecord, StateChange
from aggregator.registry import PodViewFacts
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.classify import truncate_reason
from servehealth_common.pod_identity import DNS_LABEL, DNS_SUBDOMAIN, PodInfo, PodKey
from servehealth_common.states import OBSERVABLE_STATES, Source, label_value

_REPORTABLE = {int(state): state for state in OBSERVABLE_STATES}


class InvalidMessage(ValueError):
    pass


UNDECODABLE_TEXT = "a message on this Report stream could not be decoded as an AgentMessage"
# What the deserializer hands over for bytes that are not an AgentMessage: one shared empty
# message, so it reads as "no kind", and only the error branch that follows asks whether it was
# this one (no cost to a good report).
UNDECODABLE = pb.AgentMessage()


def decode_agent_message(data: bytes) -> pb.AgentMessage:
    """``AgentMessage.FromString`` that never raises (gRPC would answer INTERNAL)."""
    try:
        return pb.AgentMessage.FromString(data)
    except DecodeError:
        return UNDECODABLE


def _pod_key(ref: pb.PodRef, where: str) -> PodKey:
    if not ref.namespace:
        raise InvalidMessage(f"{where}.namespace is empty")
    if not ref.name:
        raise InvalidMessage(f"{where}.name is empty")
    if not DNS_LABEL.fullmatch(ref.namespace):
        raise InvalidMessage(f"{where}.namespace {ref.namespace[:80]!r} is not a valid namespace")
    if not DNS_SUBDOMAIN.fullmatch(ref.name):
        raise InvalidMessage(f"{where}.name {ref.name[:80]!r} is not a valid pod name")
    return PodKey(ref.namespace, ref.name)


def pods_from_hello(hello: pb.Hello) -> list[PodInfo]:
    """The pods a hello names: its own pod for a sidecar, none yet for a DaemonSet agent."""
    if hello.mode == pb.AGENT_MODE_SIDECAR:
        if not hello.HasField("pod"):
            raise InvalidMessage("hello.pod is required in sidecar mode")
        key = _pod_key(hello.pod, "hello.pod")
        return [PodInfo(key, hello.pod.uid, hello.node_name)]
    if hello.mode == pb.AGENT_MODE_DAEMONSET:
        if not hello.node_name:
            raise InvalidMessage("hello.node_name is required in daemonset mode")
        return []
    raise InvalidMessage(
        f"hello.mode must be AGENT_MODE_SIDECAR or AGENT_MODE_DAEMONSET, got {hello.mode}"
    )


def observation_from_report(
    report: pb.PodReport, own_pod: PodKey | None
) -> tuple[PodKey, Observation]:
    """Validate one report. ``own_pod`` is the sidecar's pod (None for a DaemonSet agent)."""
    state = _REPORTABLE.get(report.state)
    if state is None:
        raise InvalidMessage(
            f"report.state {_state_name(report.state)} is not a state an agent may report "
            f"(one of {', '.join(sorted(pb.ServeState.Name(s) for s in _REPORTABLE))})"
        )
    if report.HasField("pod"):
        key = _pod_key(report.pod, "report.pod")
        if own_pod is not None and key != own_pod:
            raise InvalidMessage(f"a sidecar for {own_pod} may not report for pod {key}")
    elif own_pod is not None:
        key = own_pod
    else:
        raise InvalidMessage("report.pod is required in daemonset mode")
    latency = report.probe_latency
    return key, Observation(
        state,
        # Cut here, before the core stores or logs it: 256 bytes of UTF-8, as the agent cuts
        # its own (a raw client's reason of 256 characters may be 1 KiB).
        truncate_reason(report.reason),
        report.http_status,
        latency.seconds + latency.nanos / 1e9,
        Source.PUSH,
    )


def _state_name(value: int) -> str:
    try:
        return pb.ServeState.Name(value)
    except ValueError:
        return f"{value} (unknown)"


def duration(seconds: float) -> Duration:
    message = Duration()
    message.FromNanoseconds(round(seconds * 1e9))
    return message


def timestamp(seconds: float) -> Timestamp:
    message = Timestamp()
    message.FromNanoseconds(round(seconds * 1e9))
    return message


def pod_message(record: PodRecord, now: float, wall_now: float) -> pb.Pod:
    """``now`` is the tracker's monotonic time, ``wall_now`` the wall clock at the same instant."""
    message = pb.Pod(
        namespace=record.key.namespace,
        name=record.key.name,
        uid=record.uid,
        node_name=record.node_name,
        state=int(record.state),
        reason=record.reason,
        http_status=record.http_status,
        source=int(record.source) if record.source else pb.SOURCE_UNSPECIFIED,
        desired_label=record.desired_label,
        agent_connected=record.agent is not None,
        probe_latency=duration(record.latency),
        state_since=timestamp(wall_now - (now - record.state_since)),
    )
    if record.observed_at is not None:
        message.last_report_age.CopyFrom(duration(max(0.0, now - record.observed_at)))
    return message


def pod_view_message(view: PodViewFacts) -> pb.PodView:
    """A sidecar's pod as the backend last saw it; ``label`` and ``condition`` stay unset where
    the pod has none."""
    return pb.PodView(
        pod=pb.PodRef(namespace=view.key.namespace, name=view.key.name, uid=view.uid),
        resource_version=view.resource_version,
        node_name=view.node_name,
        gated=view.gated,
        overridden=view.overridden,
        override=view.override,
        label=view.label,  # None: unset
        condition=view.condition,
    )


def transition_message(transition: StateChange, now: float, wall_now: float) -> pb.Transition:
    return pb.Transition(
        namespace=transition.key.namespace,
        name=transition.key.name,
        from_state=int(transition.old),
        to_state=int(transition.new),
        source=int(transition.source) if transition.source else pb.SOURCE_UNSPECIFIED,
        reason=transition.reason,
        desired_label=label_value(transition.new),
        time=timestamp(wall_now - (now - transition.at)),
    )
