"""The Lease gate judges only what it observes (issue 26; found by bench.fallback_storm: agents
wrote while the aggregator still renewed its Lease): between two watches of the Lease (the
agent waits for its slot of the API budget) the decider begins no fallback, hands out no write
and lets none go; once the Lease is read again, a renewal made in the gap counts."""

from __future__ import annotations

from node_agent.fallback.decider import Fallback, FallbackPhase
from node_agent.fallback.lease_gate import LeaseName, LeaseSeen
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

KEY = PodKey("ray", "worker-0")
GATE = "ray.io/serve-proxy-healthy"
LEASE = LeaseName("serve-health", "aggregator")
DURATION = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def renewal(n: int) -> LeaseSeen:
    return LeaseSeen(holder="aggregator-0", renew_time=str(n), duration=DURATION)


def failing_agent() -> tuple[Fallback, Clock]:
    clock = Clock()
    core = Fallback(
        after=10,
        own=WhosePods(pod=KEY, uid="u"),
        flag_rules=WriteRules(condition_type=GATE),
        clock=clock,
        lease=LEASE,
    )
    core.stream_up()
    core.stream_down()
    core.pod_seen(PodFacts(KEY, "u", conditions={GATE: "True"}, readiness_gates=frozenset({GATE})))
    core.observe(KEY, ServeState.NOT_READY)
    clock.now += 10
    return core, clock


def test_no_fallback_begins_while_the_lease_is_not_observed() -> None:
    core, clock = failing_agent()
    assert core.lease is not None
    core.lease.seen(renewal(1))  # read: renewed (first seen)
    core.lease.gap()  # the watch ended; the next waits for a slot
    clock.now += DURATION + 60  # long enough to look expired ...
    assert core.tick() is None  # ... but nothing is judged in the gap
    assert core.phase is FallbackPhase.WAITING
    core.lease.seen(renewal(7))  # read again: it was renewed meanwhile
    assert core.tick() is None
    assert core.phase is FallbackPhase.WAITING


def test_no_write_is_handed_out_or_sent_in_a_gap() -> None:
    core, _ = failing_agent()
    assert core.lease is not None
    core.lease.absent()  # no aggregator leads
    assert core.tick() is not None
    assert core.phase is FallbackPhase.FALLBACK
    [write] = core.decide()
    core.lease.gap()
    assert not core.still_wanted(write)  # not sent while unobserved
    core.finished(write)
    core.observe(KEY, ServeState.NOT_READY)
    assert core.decide() == []  # nor decided
    core.lease.absent()  # read again: still none
    [again] = core.decide()
    assert again.value == "False"
    assert core.still_wanted(again)
