"""What an agent in fallback sends nothing for (issue 26), pure, on a fake clock: a pod that
carries what its probes say is no work (no Lease read); a sidecar's pod nobody told it about
needs a read, a DaemonSet agent's never (its watch tells it); a conditional write that found
the pod changed (409) stops writes for that pod until a newer version is seen; an override
holds a decided write back."""

from __future__ import annotations

from dataclasses import replace

from node_agent.fallback.decider import Fallback
from node_agent.fallback.lease_gate import LeaseName
from node_agent.fallback.rules import PodFacts, WhosePods, WriteRules
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

KEY = PodKey("ray", "worker-0")
UID = "uid-0"
GATE = "ray.io/serve-proxy-healthy"
AFTER = 10.0
LEASE = LeaseName("serve-health", "aggregator")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def facts(version: str, carries: str = "True", *, overridden: bool = False) -> PodFacts:
    return PodFacts(
        KEY,
        UID,
        conditions={GATE: carries},
        readiness_gates=frozenset({GATE}),
        overridden=overridden,
        resource_version=version,
    )


SIDECAR = WhosePods(pod=KEY, uid=UID)


def decider(own: WhosePods = SIDECAR) -> tuple[Fallback, Clock]:
    clock = Clock()
    core = Fallback(
        after=AFTER, own=own, flag_rules=WriteRules(condition_type=GATE), clock=clock, lease=LEASE
    )
    core.stream_up()
    core.stream_down()
    clock.now += AFTER
    return core, clock


def test_a_pod_that_carries_what_its_probes_say_is_no_work() -> None:
    core, _ = decider()
    core.pod_seen(facts("5", "True"))
    for _ in range(2):
        core.observe(KEY, ServeState.SERVING)
    assert not core.has_work()
    assert not core.lease_wanted()  # no Lease read, no client
    core.observe(KEY, ServeState.NOT_READY)
    assert core.has_work()
    assert core.lease_wanted()


def test_a_sidecar_reads_its_pod_only_when_nobody_told_it() -> None:
    core, _ = decider()
    core.observe(KEY, ServeState.UNHEALTHY)  # decides nothing: no read either
    assert not core.needs_facts(KEY)
    core.observe(KEY, ServeState.NOT_READY)
    assert core.needs_facts(KEY)
    assert core.has_work()
    core.pod_seen(facts("5", "False"))  # told (or read): it carries it already
    assert not core.needs_facts(KEY)
    assert not core.has_work()


def test_a_daemonset_agent_never_reads_a_pod() -> None:
    core, _ = decider(WhosePods(node_name="node-1"))
    core.observe(KEY, ServeState.NOT_READY)
    assert not core.needs_facts(KEY)  # its watch tells it
    assert not core.has_work()


def test_a_conflict_stops_writes_until_a_newer_version_is_seen() -> None:
    core, _ = decider()
    core.pod_seen(facts("5", "True"))
    core.observe(KEY, ServeState.NOT_READY)
    assert core.lease is not None
    core.lease.absent()  # no aggregator leads
    assert core.tick() is not None
    [write] = core.decide()
    assert write.version == "5"
    core.conflicted(write)  # 409: the pod changed since version 5
    core.observe(KEY, ServeState.NOT_READY)
    assert core.decide() == []
    assert core.needs_facts(KEY)  # a sidecar reads it
    core.pod_seen(facts("5", "True"))  # the same version again: still stale
    assert core.decide() == []
    core.pod_seen(facts("9", "True", overridden=True))  # newer: an override came
    assert not core.needs_facts(KEY)
    assert core.decide() == []  # the operator decides
    assert core.held(KEY)
    core.pod_seen(replace(facts("10", "True"), overridden=False))  # taken off
    [again] = core.decide()
    assert (again.value, again.version) == ("False", "10")
    assert not core.held(KEY)
