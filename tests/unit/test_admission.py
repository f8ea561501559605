"""Admission rules alone (``aggregator.ingest.admission``): streams per client address, unknown
pods, node binding and pods per stream, each as an outcome (the gRPC mapping is tested through real
streams in tests/aggregator/test_limits.py and tests/kube/test_auth.py)."""

from __future__ import annotations

import pytest

from aggregator.auth import PermissionDenied
from aggregator.ingest.admission import (
    ADMITTED,
    Refusal,
    StreamsPerPeer,
    new_pod_on_stream,
    peer_host,
    unknown_pod,
)
from aggregator.ingest.report_service import STATUS_OF
from servehealth_common.pod_identity import PodInfo, PodKey

KEY = PodKey("ns", "pod-a")


def test_streams_per_peer_are_counted_and_freed() -> None:
    peers = StreamsPerPeer(2)
    assert peers.open("10.0.0.1") is ADMITTED
    assert peers.open("10.0.0.1") is ADMITTED
    third = peers.open("10.0.0.1")
    assert third.refusal is Refusal.TOO_MANY_STREAMS
    assert "--max-streams-per-peer 2" in third.message
    assert peers.open("10.0.0.2") is ADMITTED  # another address has its own count
    peers.close("10.0.0.1")
    assert peers.open("10.0.0.1") is ADMITTED


@pytest.mark.parametrize(
    ("node", "pod", "on_stream", "expected"),
    [
        pytest.param(None, None, 0, None, id="no-binding"),
        pytest.param("n1", PodInfo(KEY, node_name="n1"), 0, None, id="own-node"),
        pytest.param("n1", None, 0, None, id="unknown-pod-left-to-the-core"),
        pytest.param("n1", PodInfo(KEY, node_name=""), 0, "pod_unscheduled", id="unscheduled"),
        pytest.param("n1", PodInfo(KEY, node_name="n2"), 0, Refusal.WRONG_NODE, id="other-node"),
        pytest.param(None, None, 3, Refusal.TOO_MANY_PODS, id="too-many-pods"),
        pytest.param(None, None, 2, None, id="last-pod-that-fits"),
    ],
)
def test_a_pod_new_on_a_stream(
    node: str | None, pod: PodInfo | None, on_stream: int, expected: object
) -> None:
    outcome = new_pod_on_stream(KEY, on_stream, 3, node, pod)
    if expected is None:
        assert outcome.admitted
    elif isinstance(expected, Refusal):
        assert outcome.refusal is expected
    else:
        assert (outcome.skip, outcome.refusal) == (expected, None)
    if outcome.refusal is Refusal.WRONG_NODE:
        assert isinstance(outcome.cause, PermissionDenied)  # the guard logs and counts it


def test_an_unknown_pod_refuses_a_sidecar_and_skips_a_daemonset_report() -> None:
    assert unknown_pod(True, "not known").refusal is Refusal.UNKNOWN_POD
    skipped = unknown_pod(False, "not known")
    assert (skipped.refusal, skipped.skip) == (None, "unknown_pod")


def test_every_refusal_has_a_status() -> None:
    assert set(STATUS_OF) == set(Refusal)


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.1.2.3:5000", "10.1.2.3"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:[::ffff:10.1.2.3]:5000", "10.1.2.3"),
        ("unix:/tmp/socket", "unix:/tmp/socket"),
    ],
)
def test_peer_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host
