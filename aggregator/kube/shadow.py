"""Shadow mode (``--dry-run``) on Kubernetes: a writer and an event recorder that send nothing.

:class:`ShadowWriter` stands where :class:`~aggregator.kube.writer.Writer` does, and
:class:`ShadowEvents` where :class:`~aggregator.kube.events.EventRecorder` does: the registry
hands them what it would write, and they count it
(``serve_health_would_be_writes_total{kind}``) and log it at debug level. The registry's copy of
each pod stays what the watch shows, so what pods carry (and the disagreement figures) is what
the cluster holds.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from aggregator.decision.override import OverrideChange
from aggregator.decision.shadow import WouldBeWrites
from aggregator.decision.tracker import StateChange
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.pod_writes.desired import Desired
from servehealth_common.pod_writes.rule import WriteKind


class Carried(Protocol):
    def carried(self, key: PodKey, kind: WriteKind) -> str | None:
        """What the pod carries now for ``kind`` (None: absent)."""


class ShadowWriter:
    """``Writer.enqueue`` and ``forget`` without a request; nothing is ever pending."""

    def __init__(self, pods: Carried, would_be: WouldBeWrites) -> None:
        self._pods = pods
        self._would_be = would_be
        self.pending = 0

    def enqueue(self, key: PodKey, wanted: Desired) -> None:
        """Count what the writer would write for ``key`` (each target of ``wanted``)."""
        for kind, value in wanted.targets():
            self._would_be.want(key, kind, self._pods.carried(key, kind), value)

    def forget(self, key: PodKey) -> None:
        self._would_be.forget(key)

    def pending_for(self, key: PodKey) -> bool:
        """Nothing is ever pending: nothing is sent."""
        return False

    async def run(self) -> None:
        """Nothing to do until cancelled (the registry runs its writer as a task)."""
        await asyncio.get_running_loop().create_future()


class ShadowEvents:
    """``EventRecorder.record`` without a request."""

    def __init__(self, would_be: WouldBeWrites) -> None:
        self._would_be = would_be

    def record(self, pod: PodInfo, transition: StateChange) -> None:
        self._would_be.event(pod.key, f"{transition.old.name} -> {transition.new.name}")

    def record_override(self, pod: PodInfo, change: OverrideChange) -> None:
        self._would_be.event(pod.key, f"override {change.kind}")

    async def stop(self) -> None:
        """Nothing in flight."""
