"""Where the aggregator tells agents its Lease is (``WriteSettings.lease``, issue 26): its
``--leader-elect`` Lease as ``namespace/name``, the namespace found as the election finds it;
none without ``--leader-elect`` (no gate on the agents: the behaviour before it)."""

from __future__ import annotations

from aggregator.fallback_settings import write_settings
from aggregator.flags import AggregatorFlags


def test_a_leader_electing_aggregator_names_its_lease() -> None:
    flags = AggregatorFlags(
        kube_backend="kubernetes", leader_elect=True, leader_elect_namespace="serve-health"
    )
    assert write_settings(flags, {}).lease == "serve-health/ray-serve-health-aggregator"


def test_the_namespace_comes_from_the_pod_as_for_the_election() -> None:
    flags = AggregatorFlags(
        kube_backend="kubernetes", leader_elect=True, leader_elect_lease_name="mine"
    )
    assert write_settings(flags, {"POD_NAMESPACE": "ops"}).lease == "ops/mine"


def test_without_leader_election_no_lease_is_named() -> None:
    assert write_settings(AggregatorFlags(kube_backend="kubernetes"), {}).lease == ""
    assert write_settings(AggregatorFlags(kube_backend="memory"), {}).lease == ""
