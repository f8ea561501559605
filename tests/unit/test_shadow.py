"""aggregator.decision.shadow (pure): what a pod carries against what would be written, as a
direction of traffic in each mode; would-be writes counted once per new value; and --dry-run
refusing --leader-elect (it would have to write the Lease)."""

from __future__ import annotations

import pytest

from aggregator.cli import parse
from aggregator.decision.shadow import IN, OUT, WouldBeWrites, direction, shown, tally
from aggregator.flags import AggregatorFlags
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import NO_PROXY_BY_DESIGN, WriteKind

LABEL, CONDITION = WriteKind.LABEL, WriteKind.CONDITION


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        ([(LABEL, "false", "true")], IN),
        ([(LABEL, None, "true")], IN),
        ([(LABEL, "true", "false")], OUT),
        ([(LABEL, None, "false")], None),  # absent is false: no traffic moves
        ([(LABEL, "true", "true")], None),
        ([(CONDITION, None, "True")], IN),
        ([(CONDITION, "True", "False")], OUT),
        ([(CONDITION, None, "False")], None),  # a write (the reason), not a disagreement
        ([(CONDITION, "True", NO_PROXY_BY_DESIGN)], None),  # both Ready
        ([(CONDITION, NO_PROXY_BY_DESIGN, "False")], OUT),
        ([(CONDITION, "Unknown", "True")], IN),
        # both: in service only when the label and the condition are
        ([(LABEL, "true", "true"), (CONDITION, "False", "True")], IN),
        ([(LABEL, "true", "false"), (CONDITION, "False", "False")], None),
        ([(LABEL, "true", "false"), (CONDITION, "True", "False")], OUT),
        ([], None),  # nothing written to the pod (condition mode, no gate)
    ],
)
def test_direction(targets: list, expected: str | None) -> None:
    assert direction(tuple(targets)) == expected


def test_shown_and_tally() -> None:
    assert shown([(LABEL, "true", "x")]) == "true"
    assert shown([(LABEL, None, "x")]) == ""
    assert shown([(CONDITION, NO_PROXY_BY_DESIGN, "x")]) == "True"
    assert shown([(CONDITION, None, "x")]) == ""
    assert shown([(LABEL, "true", "x"), (CONDITION, "False", "x")]) == "false"
    assert shown([]) == ""
    counted = tally([IN, None, OUT, IN])
    assert (counted.would_enter, counted.would_leave) == (2, 1)


def test_would_be_writes_count_each_new_value_once() -> None:
    counted: list[str] = []
    shadow = WouldBeWrites(counted.append)
    key = PodKey("ns", "a")
    assert shadow.want(key, LABEL, "true", "false")
    assert shadow.want(key, LABEL, "true", "false")  # wanted again: not another write
    assert not shadow.want(key, LABEL, "true", "true")  # carried already
    assert shadow.want(key, LABEL, "true", "false")  # wanted out again: a write again
    assert not shadow.want(key, LABEL, None, "false")  # absent counts as false
    assert shadow.want(key, CONDITION, None, "False")
    shadow.event(key, "SERVING -> NOT_READY")
    assert counted == ["label", "label", "condition", "event"]
    assert shadow.pending == 1  # the condition: the label needs no write any more
    shadow.forget(key)
    assert shadow.pending == 0


def test_dry_run_with_leader_elect_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--dry-run writes nothing"):
        AggregatorFlags(dry_run=True, leader_elect=True, kube_backend="kubernetes")
    with pytest.raises(SystemExit) as exited:
        parse(["--dry-run=true", "--leader-elect=true", "--kube-backend=kubernetes"])
    assert exited.value.code == 2
    assert "without --leader-elect" in capsys.readouterr().err
    assert AggregatorFlags(dry_run=True).dry_run
    assert parse(["--dry-run", "true"]).dry_run


def test_dry_run_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVE_HEALTH_DRY_RUN", "true")
    assert parse([]).dry_run
