"""The Lease gate of the agent's fallback (issue 26, ``node_agent.fallback.lease_gate`` and its use
in
``node_agent.fallback.decider``), pure, on a fake clock: an agent without a stream falls back only
while no aggregator renews the Lease (judged on the agent's own clock, as a standby does), a
fallback under way stops at once when the Lease is renewed again, an unreadable Lease leaves
the gate open, and no Lease named is today's behaviour."""

from __future__ import annotations

import pytest

from node_agent.fallback.decider import Fallback, FallbackPhase
from node_agent.fallback.lease_gate import Judged, LeaseGate, LeaseName, LeaseSeen
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

KEY = PodKey("ray", "worker-0")
LEASE = LeaseName("serve-health", "ray-serve-health-aggregator")
AFTER, DURATION = 10.0, 15.0
RULES = WriteRules(label_key="ray.io/serve")
WAITING, FALLBACK, CONNECTED = (
    FallbackPhase.WAITING,
    FallbackPhase.FALLBACK,
    FallbackPhase.CONNECTED,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def renewal(n: int, holder: str = "aggregator-0") -> LeaseSeen:
    # The Lease's own times are never compared with the agent's clock: any string will do.
    return LeaseSeen(
        holder=holder, renew_time=f"2030-01-01T00:00:{n:02d}.000000Z", duration=DURATION
    )


def decider(clock: Clock, lease: LeaseName | None = LEASE) -> Fallback:
    core = Fallback(
        after=AFTER, own=WhosePods(pod=KEY, uid="u"), flag_rules=RULES, clock=clock, lease=lease
    )
    core.pod_seen(PodFacts(key=KEY, uid="u", labels={"ray.io/serve": "true"}))
    core.observe(KEY, ServeState.NOT_READY)
    return core


def test_lease_name_parses_namespace_slash_name() -> None:
    assert LeaseName.parse("") is None
    assert LeaseName.parse("ns/name") == LeaseName("ns", "name")
    for bad in ("name", "/name", "ns/", "a/b/c"):
        with pytest.raises(ValueError, match="not namespace/name"):
            LeaseName.parse(bad)


def test_without_a_lease_fallback_begins_after_fallback_after() -> None:
    clock = Clock()
    core = decider(clock, lease=None)
    assert core.due() == 1000.0 + AFTER
    assert not core.lease_wanted()
    clock.now += AFTER
    assert core.tick() is not None
    assert core.phase is FALLBACK
    assert [w.value for w in core.decide()] == ["false"]


def test_the_lease_is_read_only_once_fallback_is_due_and_never_with_a_stream() -> None:
    clock = Clock()
    core = decider(clock)
    assert not core.lease_wanted()
    clock.now += AFTER
    assert core.lease_wanted()
    assert core.tick() is None
    assert core.phase is WAITING
    assert core.due() is None
    core.stream_up()
    assert not core.lease_wanted()


def test_a_renewed_lease_holds_fallback_back_however_long_the_stream_is_refused() -> None:
    clock = Clock()
    core = decider(clock)
    clock.now += AFTER
    assert core.lease is not None
    for n in range(60):  # ten minutes of renewals every 10 s: an aggregator refuses this agent
        core.lease.seen(renewal(n))
        assert core.tick() is None
        assert core.phase is WAITING
        assert core.decide() == []
        clock.now += 10.0


def test_a_lease_no_longer_renewed_lets_fallback_begin_a_lease_duration_after_the_last_change() -> (
    None
):
    clock = Clock()
    core = decider(clock)
    clock.now += AFTER
    assert core.lease is not None
    core.lease.seen(renewal(1))
    changed = clock.now
    clock.now += 5.0
    core.lease.seen(renewal(1))  # the same record again: not a renewal
    assert core.due() == changed + DURATION
    clock.now = changed + DURATION - 0.1
    assert core.tick() is None
    clock.now = changed + DURATION
    assert core.tick() is not None
    assert core.phase is FALLBACK


def test_fallback_stops_at_once_when_the_lease_is_renewed_again() -> None:
    clock = Clock()
    core = decider(clock)
    clock.now += AFTER
    assert core.lease is not None
    core.lease.absent()  # no aggregator leads
    assert core.tick() is not None
    assert core.phase is FALLBACK
    (write,) = core.decide()
    core.lease.seen(renewal(2, holder="aggregator-1"))  # a new leader, before it accepts us
    change = core.tick()
    assert change is not None
    assert (change.old, change.new) == (FALLBACK, WAITING)
    assert not core.still_wanted(write)  # a write not yet sent is dropped
    assert core.decide() == []
    assert core.lease_wanted()  # still read: the next fallback needs it


@pytest.mark.parametrize("holder", ["", "aggregator-0"])
def test_a_released_or_missing_lease_is_not_renewed(holder: str) -> None:
    clock = Clock()
    gate = LeaseGate(LEASE, clock)
    assert gate.renewed_until() is None
    if holder:
        gate.absent()
    else:
        gate.seen(LeaseSeen(holder="", renew_time="", duration=DURATION))
    assert gate.renewed_until() == float("-inf")
    assert not gate.renewed()


def test_an_unreadable_lease_opens_the_gate_only_if_never_seen() -> None:
    clock = Clock()
    gate = LeaseGate(LEASE, clock)
    gate.unreadable()  # a 403: no RBAC for the Lease, as before the gate
    assert gate.judged is Judged.OPEN
    assert gate.renewed_until() == float("-inf")
    gate.seen(renewal(1))
    gate.unreadable()  # once seen, it ages out by itself
    assert gate.renewed()
    clock.now += DURATION
    assert not gate.renewed()


def test_the_aggregators_settings_name_the_lease_and_a_stream_forgets_what_was_seen() -> None:
    clock = Clock()
    core = decider(clock, lease=None)
    core.learned_lease(LEASE)
    assert core.lease is not None
    assert core.lease.name == LEASE
    core.lease.seen(renewal(1))
    core.learned_lease(LEASE)  # the same Lease: what was seen stays
    assert core.lease.judged is Judged.SEEN
    core.stream_up()
    assert core.lease.judged is Judged.UNREAD
    core.learned_lease(None)  # an aggregator without --leader-elect
    assert core.lease is None
