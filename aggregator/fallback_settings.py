"""What an aggregator tells agents about their fallback (``AgentSettings.writes``): what it
writes, whether they may write it themselves when no aggregator answers, and where its
leader-election Lease is (an agent falls back only while no aggregator renews it: issue 26)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from aggregator.flags import AggregatorFlags
from aggregator.leader.lease import LeaderElectionConfigError, lease_namespace
from servehealth.v1 import servehealth_pb2 as pb


def write_settings(
    flags: AggregatorFlags, environ: Mapping[str, str] = os.environ
) -> pb.WriteSettings:
    """What this aggregator writes, for agents in fallback (--agent-fallback); in shadow mode
    (--dry-run) they may not write (they keep that over their own --fallback-write)."""
    condition = flags.mode in ("condition", "both")
    allowed = flags.agent_fallback == "on" or (flags.agent_fallback == "auto" and condition)
    return pb.WriteSettings(
        label=flags.mode in ("label", "both"),
        label_key=flags.label_key,
        condition=condition,
        condition_type=flags.condition_type,
        failure_threshold=flags.failure_threshold,
        success_threshold=flags.success_threshold,
        fallback=allowed and not flags.dry_run,
        lease=lease_of(flags, environ),
    )


def lease_of(flags: AggregatorFlags, environ: Mapping[str, str]) -> str:
    """``namespace/name`` of the Lease agents judge aggregators alive by ("": none)."""
    if not flags.leader_elect or flags.kube_backend == "memory":
        return ""
    try:
        namespace = lease_namespace(flags.leader_elect_namespace, environ)
    except LeaderElectionConfigError:
        return ""  # the election refuses to start with the same message
    return f"{namespace}/{flags.leader_elect_lease_name}"
