"""What a pod should carry (``servehealth_common/pod_writes/desired.py``, pure): the override,
the mode, the readiness gate, NoProxyByDesign, a drift repair's unwritten condition, the
condition's message, and which targets the write rule then calls for; on a table, and every
combination of the inputs against the rules."""

from __future__ import annotations

import itertools

import pytest

from servehealth_common.override import ANNOTATION, IN_SERVICE, NONE, OUT_OF_SERVICE, Override
from servehealth_common.pod_writes.desired import Desired, Known, desired, override_message
from servehealth_common.pod_writes.rule import NO_PROXY_BY_DESIGN, WriteKind, write_needed

OUT = Override(value=OUT_OF_SERVICE)
IN = Override(value=IN_SERVICE)
BAD = Override(ignored="maintenance")
OUT_MESSAGE = f"override out-of-service ({ANNOTATION}): the pod's health does not decide"
IN_MESSAGE = f"override in-service ({ANNOTATION}): the pod's health does not decide"
MOVED = "NOT_READY: HTTP 503"
L, C = WriteKind.LABEL, WriteKind.CONDITION


def known(
    health: str | None = "true",
    mode: str = "both",
    *,
    gated: bool = True,
    override: Override = NONE,
    by_design: bool = False,
    label: str | None = None,
    condition: str | None = None,
    message: str | None = None,
    repair: bool = False,
) -> Known:
    return Known(
        health,
        writes_label=mode in ("label", "both"),
        writes_condition=mode in ("condition", "both"),
        gated=gated,
        override=override,
        by_design=by_design,
        label=label,
        condition=condition,
        message=message,
        repair=repair,
    )


def want(
    value: str | None,
    label: str | None = None,
    condition: str | None = None,
    message: str | None = None,
    writes: tuple[WriteKind, ...] = (),
) -> Desired:
    return Desired(value, label, condition, message, frozenset(writes))


TABLE = [
    # -- the override beats the pod's health (and PANIC's holds) ---------------------------
    pytest.param(known("true", "label"), want("true", "true", writes=(L,)), id="health-decides"),
    pytest.param(
        known(None, label="true", condition="True"), want(None), id="none-leaves-all-panic-holds"
    ),
    pytest.param(
        known("true", "label", override=OUT, label="true"),
        want("false", "false", writes=(L,)),
        id="out-beats-healthy",
    ),
    pytest.param(
        known(None, override=OUT, label="true", condition="True"),
        want("false", "false", "False", OUT_MESSAGE, (L, C)),
        id="out-not-held-by-panic",
    ),
    pytest.param(
        known("false", override=IN, message=MOVED),
        want("true", "true", "True", IN_MESSAGE, (L, C)),
        id="in-beats-failing-its-message-too",
    ),
    pytest.param(
        known("false", override=BAD, message=MOVED),
        want("false", "false", "False", MOVED, (C,)),
        id="ignored-override-health-decides",
    ),
    # -- the mode and the readiness gate ---------------------------------------------------
    pytest.param(
        known("true", "label", gated=True), want("true", "true", writes=(L,)), id="label-mode"
    ),
    pytest.param(
        known("true", "condition", label="false"),
        want("true", condition="True", writes=(C,)),
        id="condition-mode-label-not-ours",
    ),
    pytest.param(
        known("true", "condition", gated=False), want("true"), id="condition-mode-ungated-nothing"
    ),
    pytest.param(
        known("true", "both", gated=False), want("true", "true", writes=(L,)), id="both-ungated"
    ),
    pytest.param(
        known("false", "both", label="true", condition="True"),
        want("false", "false", "False", writes=(L, C)),
        id="both-gated",
    ),
    # -- NoProxyByDesign -------------------------------------------------------------------
    pytest.param(
        known("false", "condition", by_design=True, condition="False"),
        want("false", condition=NO_PROXY_BY_DESIGN, writes=(C,)),
        id="by-design-condition-true",
    ),
    pytest.param(
        known("false", "both", by_design=True, condition=NO_PROXY_BY_DESIGN),
        want("false", "false", NO_PROXY_BY_DESIGN),
        id="by-design-carried-no-write",
    ),
    pytest.param(
        known("false", "label", by_design=True, label="true"),
        want("false", "false", writes=(L,)),
        id="by-design-label-still-false",
    ),
    pytest.param(
        known("false", "condition", by_design=True, override=OUT, condition=NO_PROXY_BY_DESIGN),
        want("false", condition="False", message=OUT_MESSAGE, writes=(C,)),
        id="by-design-unless-overridden-out",
    ),
    pytest.param(
        known("false", "condition", by_design=True, override=IN),
        want("true", condition="True", message=IN_MESSAGE, writes=(C,)),
        id="by-design-overridden-in",
    ),
    pytest.param(
        known("false", "condition", by_design=True, override=BAD),
        want("false", condition=NO_PROXY_BY_DESIGN, writes=(C,)),
        id="by-design-ignored-override",
    ),
    # -- a drift repair: a condition nobody wrote yet is not drift --------------------------
    pytest.param(
        known("true", "both", repair=True, label="true"),
        want("true", "true"),
        id="repair-unwritten-condition-left",
    ),
    pytest.param(
        known("true", "condition", repair=True), want("true"), id="repair-unwritten-nothing"
    ),
    pytest.param(
        known("true", "condition", repair=True, condition="True"),
        want("true", condition="True"),
        id="repair-carried-no-drift",
    ),
    pytest.param(
        known("true", "condition", repair=True, condition="False"),
        want("true", condition="True", writes=(C,)),
        id="repair-drift-put-back-message-kept",
    ),
    pytest.param(
        known("true", "condition", repair=True, override=OUT),
        want("false", condition="False", message=OUT_MESSAGE, writes=(C,)),
        id="repair-unwritten-override-writes",
    ),
    pytest.param(
        known(None, "condition", repair=True, condition="False"),
        want(None),
        id="repair-held-leaves",
    ),
    pytest.param(
        known("true", "condition"),
        want("true", condition="True", writes=(C,)),
        id="transition-writes-unwritten-condition",
    ),
    # -- the condition's message -----------------------------------------------------------
    pytest.param(
        known("false", "condition", message=MOVED, condition="True"),
        want("false", condition="False", message=MOVED, writes=(C,)),
        id="transition-message",
    ),
    pytest.param(
        known("false", "condition", message="x" * 600),
        want("false", condition="False", message="x" * 512, writes=(C,)),
        id="message-capped",
    ),
    pytest.param(
        known("false", "label", message=MOVED, label="true"),
        want("false", "false", writes=(L,)),
        id="no-condition-no-message",
    ),
    # -- the write rule: a missing label counts as "false" ---------------------------------
    pytest.param(known("false", "label"), want("false", "false"), id="missing-label-is-false"),
    pytest.param(
        known("true", "label", label=None), want("true", "true", writes=(L,)), id="missing-true"
    ),
    pytest.param(
        known("false", "condition"),
        want("false", condition="False", writes=(C,)),
        id="missing-condition-carries-nothing",
    ),
    pytest.param(
        known("false", "condition", condition=NO_PROXY_BY_DESIGN),
        want("false", condition="False", writes=(C,)),
        id="by-design-carried-no-longer-so",
    ),
]


@pytest.mark.parametrize(("pod", "expected"), TABLE)
def test_desired(pod: Known, expected: Desired) -> None:
    assert desired(pod) == expected


def test_targets_label_then_condition() -> None:
    found = desired(known("false", by_design=True))
    assert list(found.targets()) == [(L, "false"), (C, NO_PROXY_BY_DESIGN)]
    assert list(desired(known(None)).targets()) == []


def test_override_message() -> None:
    assert override_message(OUT) == OUT_MESSAGE
    assert override_message(NONE) is None
    assert override_message(BAD) is None


CARRIED_LABELS = (None, "true", "false")
CARRIED_CONDITIONS = (None, "True", "False", NO_PROXY_BY_DESIGN)


@pytest.mark.parametrize("mode", ["label", "condition", "both"])
@pytest.mark.parametrize("override", [NONE, OUT, IN, BAD], ids=["none", "out", "in", "bad"])
@pytest.mark.parametrize("health", [None, "true", "false"])
def test_every_combination_follows_the_rules(
    mode: str, override: Override, health: str | None
) -> None:
    for gated, by_design, label, condition, message, repair in itertools.product(
        (False, True),
        (False, True),
        CARRIED_LABELS,
        CARRIED_CONDITIONS,
        (None, MOVED),
        (False, True),
    ):
        pod = known(
            health,
            mode,
            gated=gated,
            override=override,
            by_design=by_design,
            label=label,
            condition=condition,
            message=message,
            repair=repair,
        )
        found = desired(pod)
        value = override.label if override.label is not None else health
        assert found.value == value
        if value is None:
            assert found == Desired()
            continue
        assert found.label == (value if pod.writes_label else None)
        condition_wanted = (
            pod.writes_condition
            and gated
            and (not repair or condition is not None or override.value is not None)
        )
        if not condition_wanted:
            assert (found.condition, found.message) == (None, None)
        else:
            honoured = override.value is not None
            expected = "True" if value == "true" else "False"
            if value == "false" and by_design and not honoured:
                expected = NO_PROXY_BY_DESIGN
            assert found.condition == expected
            assert found.message == (override_message(override) if honoured else message)
        carried = {L: label, C: condition}
        assert found.writes == {
            kind for kind, wanted in found.targets() if write_needed(kind, carried[kind], wanted)
        }
