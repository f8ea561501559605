"""A pod gone takes its fallback writes with it (issue 26, bug 6): the decider's writes in
flight and given up for a pod that is gone (or no longer probed) are forgotten with it, so that
a pod seen again (a DaemonSet agent probes it again, a pod recreated under its name) is decided
afresh. Pure, on a fake clock."""

from __future__ import annotations

from servehealth_common.states import ServeState
from tests.unit.test_fallback_outage_rules import KEY, fallen_back, pod


def test_a_pod_gone_takes_its_write_in_flight_with_it() -> None:
    core = fallen_back(pod())
    core.observe(KEY, ServeState.NOT_READY)
    [write] = core.decide()  # in flight, never finished (the writer was cancelled)
    core.pod_gone(KEY)
    assert not core.still_wanted(write)
    core.pod_seen(pod(version=11))  # the pod seen again (a DaemonSet agent probes it again)
    core.observe(KEY, ServeState.NOT_READY)
    [again] = core.decide()
    assert again.value == "False"


def test_a_pod_gone_takes_its_given_up_write_with_it() -> None:
    core = fallen_back(pod())
    core.observe(KEY, ServeState.NOT_READY)
    [write] = core.decide()
    core.finished(write, gave_up=True)  # e.g. a 403
    core.observe(KEY, ServeState.NOT_READY)
    assert core.decide() == []  # not tried again in this fallback
    core.pod_gone(KEY)
    core.pod_seen(pod(version=11))
    core.observe(KEY, ServeState.NOT_READY)
    [again] = core.decide()
    assert again.value == "False"
