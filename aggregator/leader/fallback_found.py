"""At a take-over: how many pods did agents write while no aggregator was there?

Agents in fallback (``node_agent``, ``--fallback-after``) mark what they write
(:mod:`servehealth_common.fallback_marks`). A replica that takes the Lease over counts, once
its first pod list is in, the pods whose mark is newer than the previous leader's last renewal
of the Lease (when an aggregator was last alive), compared at the mark's resolution
(:func:`~servehealth_common.fallback_marks.written_after`). Without a Lease (no
``--leader-elect``) it counts the marks still standing: the aggregator removes the annotation
when it next writes the label (:mod:`aggregator.kube.writer`), and its own condition replaces
the agents' reason, so a mark stands only while an agent's write is the pod's latest. It writes
nothing for them: an agent wrote what the aggregator wants, and the pods were seeded from it.
"""

from __future__ import annotations

import logging

from aggregator.leader.elector import LeaseRecord
from aggregator.metrics import Metrics
from aggregator.registry import PodRegistry
from servehealth_common.pod_writes.times import parse_time

log = logging.getLogger(__name__)


def count_agent_writes(
    registry: PodRegistry, previous: LeaseRecord | None, metrics: Metrics
) -> int:
    """Count, log (when any) and export the pods agents wrote since ``previous`` was renewed."""
    since = parse_time(previous.renew_time) if previous is not None else None
    found = registry.changed_by_agents(since)
    metrics.agent_fallback_pods.set(found)
    if found:
        after = (
            f"since {previous.renew_time} (the last leader's last renewal)"
            if since is not None and previous is not None
            else ""
        )
        log.warning(
            "%d pods were written by agents in fallback (no aggregator answered them) %s; "
            "seeded from what they carry, nothing rewritten",
            found,
            after,
        )
    return found
