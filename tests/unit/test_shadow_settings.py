"""A shadow aggregator never arms the agents (issue 26, bug 3): with ``--dry-run`` the write
settings it sends forbid the agents' fallback writes, whatever ``--agent-fallback`` and the
mode say, and an agent that receives them writes nothing, not even with its own
``--fallback-write`` flags (the last aggregator's settings win once received).
"""

from __future__ import annotations

import pytest

from aggregator.flags import AggregatorFlags
from aggregator.wiring import write_settings
from node_agent.fallback.decider import Fallback
from node_agent.fallback.rules import WhosePods, WriteRules
from node_agent.fallback.wire import rules_from
from servehealth_common.pod_identity import PodKey

MODES = ("label", "condition", "both")
CHOICES = ("auto", "on", "off")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agent_fallback", CHOICES)
def test_a_shadow_aggregator_forbids_fallback_writes(mode: str, agent_fallback: str) -> None:
    flags = AggregatorFlags(mode=mode, agent_fallback=agent_fallback, dry_run=True)
    writes = write_settings(flags)
    assert writes.fallback is False
    assert rules_from(writes) is None


@pytest.mark.parametrize(
    ("mode", "agent_fallback", "allowed"),
    [
        ("label", "auto", False),
        ("condition", "auto", True),
        ("both", "auto", True),
        ("label", "on", True),
        ("condition", "off", False),
    ],
)
def test_a_writing_aggregator_allows_them_as_agent_fallback_says(
    mode: str, agent_fallback: str, allowed: bool
) -> None:
    writes = write_settings(AggregatorFlags(mode=mode, agent_fallback=agent_fallback))
    assert writes.fallback is allowed


def test_an_agent_told_so_by_a_shadow_aggregator_ignores_its_own_flags() -> None:
    now = [0.0]
    key = PodKey("ray", "worker-0")
    core = Fallback(
        after=2.0,
        own=WhosePods(pod=key, uid="uid-0"),
        flag_rules=WriteRules(condition_type="ray.io/serve-proxy-healthy"),
        clock=lambda: now[0],
    )
    shadow = write_settings(AggregatorFlags(mode="condition", agent_fallback="on", dry_run=True))
    assert core.learned(rules_from(shadow)) is None
    core.stream_up()
    core.stream_down()
    now[0] += 60
    assert core.due() is None
    assert core.tick() is None
    assert core.decide() == []
