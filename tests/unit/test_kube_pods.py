"""Which of two versions of a pod is the later one (stale watch events are ignored), as the
aggregator's parsed pods tell (``KubePod.writable.earlier_than``, the agents' rule too)."""

from __future__ import annotations

import pytest

from aggregator.kube.pods import KubePod, parse_pod


def older(pod: KubePod, known: KubePod) -> bool:
    return pod.writable.earlier_than(known.writable)


def pod(resource_version: str, uid: str = "u1") -> KubePod:
    body = {"metadata": {"namespace": "ns", "name": "p", "uid": uid}}
    body["metadata"]["resourceVersion"] = resource_version
    return parse_pod(body, 8000)


@pytest.mark.parametrize(
    ("new", "known", "is_older"),
    [
        ("9", "10", True),  # integers, not strings: "9" > "10" as text
        ("10", "10", False),
        ("11", "10", False),
        ("", "10", False),  # unknown: taken as newer
        ("abc", "10", False),  # opaque: taken as newer
    ],
)
def test_older_compares_resource_versions_as_integers(new: str, known: str, is_older: bool) -> None:
    assert older(pod(new), pod(known)) is is_older


def test_a_new_pod_of_the_same_name_is_never_older() -> None:
    assert older(pod("5", uid="u2"), pod("10", uid="u1")) is False
