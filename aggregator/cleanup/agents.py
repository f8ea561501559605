"""Before ``serve-health-cleanup`` changes anything: are agents writing in fallback? (pure)

Agents fall back when no aggregator answers them (``node_agent``, ``--fallback-after``; in
readiness-gate mode by default) and then write back what the cleanup changes: it sets a gated
pod's condition True, an agent whose probes fail sets it False again. docs/install.md
("Uninstalling") stops or disarms the agents before the aggregator; this says whether they were.

The evidence is the mark every fallback write leaves on its pod
(:mod:`servehealth_common.fallback_marks`), newer than the moment the aggregator went away
(its Lease's ``renewTime``: the release by a stopped aggregator, the last renewal of a crashed
one), compared at the mark's resolution (:func:`~servehealth_common.fallback_marks.written_after`):

- the annotation ``ray-serve-health/fallback-write`` beside a label: its time (microseconds)
  and the writer;
- a condition with reason ``NoAggregator``: its ``lastTransitionTime``, which an agent sets at
  every write (whole seconds), and the writer its message names.

No aggregator writes after it has gone, so such a mark is an agent's, in fallback. Without a
Lease record (no ``--leader-elect``), marks within ``--fallback-window`` of the cleanup's start
count. Why these and not the other traces of a fallback write:

- they are on the pods the cleanup lists anyway: no other request, no other permission;
- Events (reason ``NoAggregator``) would need a list of Events in every Ray namespace (the
  aggregator's account may only create them), are kept an hour (the API server's
  ``--event-ttl``), and agents send them after the write, within their API budget;
- the agents' metrics (``serve_health_agent_fallback_*``) would need every agent's port, which
  the NetworkPolicies close.

What no mark shows: an agent in fallback that has had nothing to write (its pods already
carried what its probes say) until the cleanup changes one of its pods. The documented order
prevents that; this check catches the agents that did write.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from servehealth_common import fallback_marks as marks
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.times import parse_time

#: The writer in a condition message of an agent (``node_agent.fallback.bodies``): "... written
#: by the agent <who> (<STATE>: <reason>)"; <who> may hold parentheses ("ns/pod (sidecar)").
_WRITER = re.compile(r"written by the agent (.+) \([A-Z_]+: ")
#: Pods named in a refusal, at most (then "and N more").
NAMED = 10


@dataclass(frozen=True, slots=True)
class AgentWrite:
    """One pod an agent in fallback wrote: what (its mark), when (the writer's clock), who."""

    key: PodKey
    what: str
    when: datetime.datetime
    writer: str = ""

    def describe(self) -> str:
        by = f", by the agent {self.writer}" if self.writer else ""
        return f"{self.key} ({self.what}{by}, at {self.when.strftime('%Y-%m-%dT%H:%M:%S')}Z)"


def since(renew_time: str, started: datetime.datetime, window: float) -> datetime.datetime:
    """When the aggregator went away: its Lease's ``renewTime``; without one (or one that does
    not parse), ``window`` seconds before the cleanup ``started``."""
    renewed = parse_time(renew_time) if renew_time else None
    return renewed if renewed is not None else started - datetime.timedelta(seconds=window)


def pod_marks(pod: Mapping[str, Any]) -> list[AgentWrite]:
    """Every fallback mark one pod carries (its annotation, its NoAggregator conditions)."""
    metadata = pod.get("metadata") or {}
    key = PodKey(metadata.get("namespace", ""), metadata.get("name", ""))
    found = []
    annotation = str((metadata.get("annotations") or {}).get(marks.ANNOTATION) or "")
    when = parse_time(marks.annotation_time(annotation))
    if when is not None:
        writer = annotation.partition(" ")[2]
        found.append(AgentWrite(key, f"annotation {marks.ANNOTATION} (a label)", when, writer))
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("reason") != marks.CONDITION_REASON:
            continue
        when = parse_time(str(condition.get("lastTransitionTime") or ""))
        if when is None:
            continue
        what = f"condition {condition.get('type')}={condition.get('status')}"
        named = _WRITER.search(str(condition.get("message") or ""))
        by = named[1] if named else ""
        found.append(AgentWrite(key, f"{what}, reason {marks.CONDITION_REASON}", when, by))
    return found


def agent_writes(pods: Iterable[Mapping[str, Any]], after: datetime.datetime) -> list[AgentWrite]:
    """The latest mark of each pod written ``after`` (the aggregator's departure), by pod."""
    latest: dict[PodKey, AgentWrite] = {}
    for pod in pods:
        for write in pod_marks(pod):
            newer = write.key not in latest or write.when > latest[write.key].when
            if marks.written_after(write.when, after) and newer:
                latest[write.key] = write
    return [latest[key] for key in sorted(latest, key=lambda k: (k.namespace, k.name))]


def evidence(writes: list[AgentWrite], after: str) -> str:
    """What was found: the pods agents wrote (``NAMED`` at most) ``after`` (the aggregator's
    departure, as it was judged)."""
    named = "; ".join(write.describe() for write in writes[:NAMED])
    more = f"; and {len(writes) - NAMED} more" if len(writes) > NAMED else ""
    count = f"{len(writes)} pod{'' if len(writes) == 1 else 's'}"
    return (
        f"agents in fallback (no aggregator answered them) wrote {count} after {after}: "
        f"{named}{more}"
    )


def advice(namespace: str) -> str:
    """What to do about agents in fallback (``namespace``: the aggregator's)."""
    return (
        'Stop them first, in the order of docs/install.md ("Uninstalling"): for sidecars, set '
        "SERVE_HEALTH_AGENT_FALLBACK=off in your overlay's settings and apply it (the "
        "aggregator starts again with it, and every sidecar that reconnects keeps it), or "
        "remove them from the Ray pod templates; delete the agents' DaemonSet (kubectl -n "
        f"{namespace} delete daemonset/ray-serve-health-agent); scale the aggregator to 0."
    )


def refusal(writes: list[AgentWrite], after: str, namespace: str) -> str:
    """Why the cleanup refuses, and what to do (``namespace``: the aggregator's)."""
    return (
        f"refusing to clean up: {evidence(writes, after)}. While they run they write back what "
        f"this would change. {advice(namespace)} Then run the cleanup again: if the aggregator "
        "ran in between, marks older than its release no longer count; if not, pass "
        "--force=true (SERVE_HEALTH_FORCE=true), since the marks stay on the pods until the "
        "cleanup removes them."
    )


def written_back(writes: list[AgentWrite], after: str, namespace: str) -> str:
    """What the cleanup says when agents wrote pods while (or after) it cleaned them up."""
    return (
        f"not cleaned up for good: {evidence(writes, after)}, so they write back what this "
        f"changed. {advice(namespace)} Then run the cleanup again."
    )
