"""The manual override (``aggregator/decision/override.py``, pure): what an annotation means and
which change of it is worth an Event (what the pod then should carry, the override beating its
health and PANIC's holds: tests/unit/test_desired.py)."""

from __future__ import annotations

import pytest

from aggregator.decision.override import change, reason
from servehealth_common.override import ANNOTATION, IN_SERVICE, NONE, OUT_OF_SERVICE, Override


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(None, NONE, id="absent"),
        pytest.param("out-of-service", Override(value=OUT_OF_SERVICE), id="out"),
        pytest.param("in-service", Override(value=IN_SERVICE), id="in"),
        pytest.param(" in-service\n", Override(value=IN_SERVICE), id="whitespace"),
        pytest.param("In-Service", Override(ignored="In-Service"), id="case"),
        pytest.param("", Override(ignored=""), id="empty"),
        pytest.param("true", Override(ignored="true"), id="other"),
    ],
)
def test_parse(raw: str | None, expected: Override) -> None:
    assert Override.parse(raw) == expected


OUT = Override(value=OUT_OF_SERVICE)
IN = Override(value=IN_SERVICE)
BAD = Override(ignored="maintenance")


@pytest.mark.parametrize(
    ("before", "after", "kind"),
    [
        pytest.param(NONE, OUT, "applied", id="applied"),
        pytest.param(OUT, IN, "applied", id="switched"),
        pytest.param(OUT, NONE, "removed", id="removed"),
        pytest.param(IN, BAD, "removed", id="replaced-by-a-bad-value"),
        pytest.param(NONE, BAD, "ignored", id="ignored"),
        pytest.param(BAD, Override(ignored="other"), "ignored", id="another-bad-value"),
        pytest.param(OUT, OUT, None, id="unchanged"),
        pytest.param(BAD, BAD, None, id="the-same-bad-value-once"),
        pytest.param(BAD, NONE, None, id="bad-value-removed"),
        pytest.param(NONE, NONE, None, id="nothing"),
    ],
)
def test_change(before: Override, after: Override, kind: str | None) -> None:
    found = change(before, after)
    assert (found.kind if found else None) == kind
    if found is not None:
        assert ANNOTATION in found.message
        assert found.warning == (kind == "ignored")


def test_a_bad_value_is_quoted_and_cut() -> None:
    found = change(NONE, Override(ignored="x" * 500))
    assert found is not None
    assert len(found.message) < 250


def test_reason_keeps_the_probed_one() -> None:
    assert reason(OUT, "success") == f"override out-of-service ({ANNOTATION}); probed: success"
