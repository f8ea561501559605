"""The fallback decider of an agent, from its flags (the one place both modes make it)."""

from __future__ import annotations

import random
import time

from node_agent.fallback.budget import ApiBudget
from node_agent.fallback.decider import Fallback
from node_agent.fallback.lease_gate import LeaseName
from node_agent.fallback.rules import WhosePods
from node_agent.flags import AgentFlags


def fallback_core(settings: AgentFlags, own: WhosePods, rng: random.Random) -> Fallback:
    """The decider for ``own`` pods: ``--fallback-after``, ``--fallback-write``'s rules,
    ``--fallback-lease`` and the agent's share of ``--fallback-api-budget``."""
    return Fallback(
        after=settings.fallback_after,
        own=own,
        flag_rules=settings.fallback_rules,
        lease=LeaseName.parse(settings.fallback_lease),
        clock=time.monotonic,
        budget=ApiBudget(
            fleet_budget=settings.fallback_api_budget,
            fleet_size=settings.fallback_fleet_size,
            clock=time.monotonic,
            rng=rng,
        ),
    )
