"""Every validation error of ``aggregator.ingest.wire`` (issue 12, point 5), each reached by a
message an agent (or an attacker) could send, with the text the agent reads in its INVALID_ARGUMENT.
The same errors through a real stream: tests/aggregator/test_bad_input.py."""

from __future__ import annotations

import pytest

from aggregator.ingest import wire
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

OWN = PodKey("default", "pod-a")


def sidecar_hello(**pod: str) -> pb.Hello:
    return pb.Hello(mode=pb.AGENT_MODE_SIDECAR, pod=pb.PodRef(**pod), node_name="n1")


@pytest.mark.parametrize(
    ("hello", "error"),
    [
        pytest.param(
            pb.Hello(mode=pb.AGENT_MODE_SIDECAR),
            "hello.pod is required in sidecar mode",
            id="no-pod",
        ),
        pytest.param(sidecar_hello(name="a"), "hello.pod.namespace is empty", id="no-namespace"),
        pytest.param(sidecar_hello(namespace="ns"), "hello.pod.name is empty", id="no-name"),
        pytest.param(
            sidecar_hello(namespace="Bad_NS", name="a"),
            "hello.pod.namespace 'Bad_NS' is not a valid namespace",
            id="bad-namespace",
        ),
        pytest.param(
            sidecar_hello(namespace="ns", name="p-sigINT"),
            "hello.pod.name 'p-sigINT' is not a valid pod name",
            id="bad-name",
        ),
        pytest.param(
            pb.Hello(mode=pb.AGENT_MODE_DAEMONSET),
            "hello.node_name is required in daemonset mode",
            id="daemonset-no-node",
        ),
        pytest.param(
            pb.Hello(),
            "hello.mode must be AGENT_MODE_SIDECAR or AGENT_MODE_DAEMONSET, got 0",
            id="no-mode",
        ),
        pytest.param(pb.Hello(mode=7), "got 7", id="unknown-mode"),
        pytest.param(
            sidecar_hello(namespace="ns", name="pod-a\n"),
            "is not a valid pod name",
            id="trailing-newline-in-name",
        ),
        pytest.param(
            sidecar_hello(namespace="ns\n", name="pod-a"),
            "is not a valid namespace",
            id="trailing-newline-in-namespace",
        ),
    ],
)
def test_bad_hellos(hello: pb.Hello, error: str) -> None:
    with pytest.raises(wire.InvalidMessage) as raised:
        wire.pods_from_hello(hello)
    assert error in str(raised.value)


def test_good_hellos() -> None:
    (pod,) = wire.pods_from_hello(sidecar_hello(namespace="default", name="pod-a", uid="u"))
    assert (pod.key, pod.uid, pod.node_name) == (OWN, "u", "n1")
    assert wire.pods_from_hello(pb.Hello(mode=pb.AGENT_MODE_DAEMONSET, node_name="n1")) == []


@pytest.mark.parametrize(
    ("report", "own_pod", "error"),
    [
        pytest.param(
            pb.PodReport(state=pb.SERVE_STATE_SILENT),
            OWN,
            "report.state SERVE_STATE_SILENT is not a state an agent may report",
            id="aggregator-only-state",
        ),
        pytest.param(
            pb.PodReport(state=pb.SERVE_STATE_UNKNOWN),
            OWN,
            "report.state SERVE_STATE_UNKNOWN is not a state",
            id="unknown-state",
        ),
        pytest.param(
            pb.PodReport(state=99), OWN, "report.state 99 (unknown) is not a state", id="no-state"
        ),
        pytest.param(
            pb.PodReport(
                state=pb.SERVE_STATE_SERVING, pod=pb.PodRef(namespace="default", name="b")
            ),
            OWN,
            "a sidecar for default/pod-a may not report for pod default/b",
            id="sidecar-for-another-pod",
        ),
        pytest.param(
            pb.PodReport(state=pb.SERVE_STATE_SERVING),
            None,
            "report.pod is required in daemonset mode",
            id="daemonset-without-pod",
        ),
        pytest.param(
            pb.PodReport(state=pb.SERVE_STATE_SERVING, pod=pb.PodRef(namespace="default")),
            None,
            "report.pod.name is empty",
            id="daemonset-pod-without-name",
        ),
    ],
)
def test_bad_reports(report: pb.PodReport, own_pod: PodKey | None, error: str) -> None:
    with pytest.raises(wire.InvalidMessage) as raised:
        wire.observation_from_report(report, own_pod)
    assert error in str(raised.value)


def test_a_sidecar_report_names_its_pod_or_none() -> None:
    for report in (
        pb.PodReport(state=pb.SERVE_STATE_DRAINING),
        pb.PodReport(
            state=pb.SERVE_STATE_DRAINING, pod=pb.PodRef(namespace="default", name="pod-a")
        ),
    ):
        key, observation = wire.observation_from_report(report, OWN)
        assert (key, observation.state) == (OWN, ServeState.DRAINING)
