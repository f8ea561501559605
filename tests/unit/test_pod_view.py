"""A sidecar's pod as the aggregator tells it (issue 26): the facts a Kubernetes backend reads
from a parsed pod, their wire message, and which view a Report stream sends (each
resource_version once). The same over a real stream: tests/kube/test_pod_view.py."""

from __future__ import annotations

from typing import Any

import pytest

from aggregator.ingest import wire
from aggregator.ingest.rate_limit import StreamRateLimit
from aggregator.ingest.report_stream import ReportStream
from aggregator.kube.pod_view import pod_view
from aggregator.kube.pods import parse_pod
from aggregator.metrics import Metrics
from aggregator.registry import MemoryRegistry, PodViewFacts
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.pod_identity import PodInfo, PodKey

LABEL = "ray.io/serve"
GATE = "ray.io/serve-proxy-healthy"
KEY = PodKey("ns", "pod-a")


def body(
    *,
    labels: dict[str, str] | None = None,
    conditions: list[dict[str, str]] | None = None,
    gates: list[str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": "pod-a",
            "uid": "u1",
            "resourceVersion": "42",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": {
            "nodeName": "node-1",
            "readinessGates": [{"conditionType": gate} for gate in gates or []],
        },
        "status": {"conditions": conditions or []},
    }


def view_of(pod: dict[str, Any]) -> PodViewFacts:
    return pod_view(parse_pod(pod, 8000), LABEL, GATE)


def test_the_view_of_a_bare_pod() -> None:
    assert view_of(body()) == PodViewFacts(
        key=KEY,
        uid="u1",
        resource_version="42",
        node_name="node-1",
        label=None,
        condition=None,
        gated=False,
        overridden=False,
    )


@pytest.mark.parametrize("value", ["true", "false", ""])
def test_the_label_is_the_one_the_aggregator_writes(value: str) -> None:
    view = view_of(body(labels={LABEL: value, "other": "x"}))
    assert view.label == value
    assert view_of(body(labels={"other": "true"})).label is None


@pytest.mark.parametrize(
    ("status", "reason", "condition"),
    [
        ("True", "ServeProxyServing", "True"),
        ("False", "ServeProxyNotServing", "False"),
        ("Unknown", "", "Unknown"),
        ("True", "NoProxyByDesign", "NoProxyByDesign"),
        ("False", "NoProxyByDesign", "False"),  # the reason counts only with True
    ],
)
def test_the_condition_as_the_registry_stores_it(status: str, reason: str, condition: str) -> None:
    conditions = [
        {"type": "Ready", "status": "False"},
        {"type": GATE, "status": status, "reason": reason},
    ]
    assert view_of(body(conditions=conditions)).condition == condition


def test_an_absent_condition_is_none_and_another_type_does_not_count() -> None:
    view = view_of(body(conditions=[{"type": "Ready", "status": "True"}], gates=["other/gate"]))
    assert (view.condition, view.gated) == (None, False)


def test_gated_when_the_readiness_gates_declare_the_condition() -> None:
    view = view_of(body(gates=["other/gate", GATE]))
    assert (view.gated, view.condition) == (True, None)  # declared, not written yet


@pytest.mark.parametrize(
    ("value", "overridden"),
    [
        ("in-service", True),
        ("out-of-service", True),
        (" out-of-service ", True),  # as the registry reads it: stripped
        ("maintenance", False),  # ignored by the aggregator: not an override
        ("", False),
    ],
)
def test_overridden_only_by_an_override_the_aggregator_honours(
    value: str, overridden: bool
) -> None:
    view = view_of(body(annotations={"ray-serve-health/override": value}))
    assert view.overridden is overridden


def test_the_memory_backend_has_no_view() -> None:
    registry = MemoryRegistry(LABEL)
    registry.desire(KEY, "true")
    assert registry.view(KEY) is None


# -- the wire message ----------------------------------------------------------------


def facts(**changes: Any) -> PodViewFacts:
    values: dict[str, Any] = {
        "key": KEY,
        "uid": "u1",
        "resource_version": "42",
        "node_name": "node-1",
        "label": None,
        "condition": None,
        "gated": False,
        "overridden": False,
        **changes,
    }
    return PodViewFacts(**values)


def test_the_message_leaves_absent_label_and_condition_unset() -> None:
    message = wire.pod_view_message(facts())
    assert message.pod == pb.PodRef(namespace="ns", name="pod-a", uid="u1")
    assert (message.resource_version, message.node_name) == ("42", "node-1")
    assert not message.HasField("label")
    assert not message.HasField("condition")
    assert (message.gated, message.overridden) == (False, False)


def test_the_message_carries_what_the_pod_has_even_empty() -> None:
    message = wire.pod_view_message(
        facts(label="", condition="NoProxyByDesign", gated=True, overridden=True)
    )
    assert message.HasField("label")
    assert message.label == ""
    assert message.condition == "NoProxyByDesign"
    assert (message.gated, message.overridden) == (True, True)
    # What a sidecar reads: the same message, through its bytes.
    sent = pb.AggregatorMessage(pod=message)
    received = pb.AggregatorMessage.FromString(sent.SerializeToString())
    assert received.WhichOneof("kind") == "pod"
    assert received.pod == message


# -- which view a stream sends -------------------------------------------------------


class FakeCore:
    """The one thing ReportStream.pod_view asks of the core."""

    def __init__(self) -> None:
        self.views: dict[PodKey, PodViewFacts] = {}
        self.asked = 0

    def pod_view(self, key: PodKey) -> PodViewFacts | None:
        self.asked += 1
        return self.views.get(key)


def stream(core: FakeCore, own_pod: PodKey | None, own_uid: str = "u1") -> ReportStream:
    return ReportStream(
        core,  # type: ignore[arg-type]
        Metrics("test"),
        stream_id=1,
        own=PodInfo(own_pod, own_uid) if own_pod is not None else None,
        node=None,
        rate_limit=StreamRateLimit(50, lambda: 0.0),
        max_pods=1,
        ack_every=1,
    )


def test_a_stream_sends_each_resource_version_of_its_pod_once() -> None:
    core = FakeCore()
    sidecar = stream(core, KEY)
    assert sidecar.pod_view() is None  # not known (yet)
    core.views[KEY] = facts()
    assert sidecar.pod_view() == facts()
    assert sidecar.pod_view() is None  # sent already
    core.views[KEY] = facts(resource_version="43", overridden=True)
    assert sidecar.pod_view() == facts(resource_version="43", overridden=True)
    assert sidecar.pod_view() is None


def test_a_view_of_another_pod_of_that_name_is_not_sent() -> None:
    core = FakeCore()
    core.views[KEY] = facts(uid="u2", resource_version="50")  # the pod was replaced
    assert stream(core, KEY, own_uid="u1").pod_view() is None
    assert stream(core, KEY, own_uid="").pod_view() == core.views[KEY]  # hello gave no uid


def test_a_daemonset_stream_never_asks() -> None:
    core = FakeCore()
    core.views[KEY] = facts()
    assert stream(core, None, own_uid="").pod_view() is None
    assert core.asked == 0
