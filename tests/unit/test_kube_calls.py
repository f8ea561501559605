"""The RBAC terms of each Kubernetes call's description (``verb_and_resource``), used to name
a 401/403 in the log and in ``serve_health_api_denied_total``."""

from __future__ import annotations

import pytest

from servehealth_common.kube.client import verb_and_resource


@pytest.mark.parametrize(
    ("what", "expected"),
    [
        ("patch pod ns/a", ("patch", "pods")),
        ("patch pod ns/a status", ("patch", "pods/status")),
        ("get pod ns/a", ("get", "pods")),
        ("list pods", ("list", "pods")),
        ("list pods in ray", ("list", "pods")),
        ("create event in ns", ("create", "events")),
        ("create a token review", ("create", "tokenreviews")),
        ("get lease ns/l", ("get", "leases")),
        ("create lease in ns", ("create", "leases")),
        ("update lease ns/l", ("update", "leases")),
    ],
)
def test_verb_and_resource(what: str, expected: tuple[str, str]) -> None:
    assert verb_and_resource(what) == expected
