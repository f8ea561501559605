"""One agent's Report stream after its hello: its pods, its node binding, its budget, its acks.

The servicer makes one per stream and hands it each validated report; this object applies the
admission rules (:mod:`aggregator.ingest.admission`), passes admitted reports to the core, counts
the skipped ones, and says when an ack is due, and when a sidecar's pod is to be sent (its view
changed). It knows nothing of gRPC.
"""

from __future__ import annotations

import asyncio
import logging

from aggregator.decision.core import Core, NotAdmitted
from aggregator.decision.tracker import Observation
from aggregator.ingest.admission import (
    ADMITTED,
    Outcome,
    Refusal,
    new_pod_on_stream,
    refused,
    unknown_pod,
)
from aggregator.ingest.rate_limit import StreamRateLimit
from aggregator.metrics import Metrics
from aggregator.registry import PodViewFacts
from servehealth_common.pod_identity import PodInfo, PodKey

log = logging.getLogger(__name__)


class ReportStream:
    def __init__(
        self,
        core: Core,
        metrics: Metrics,
        *,
        stream_id: int,
        own: PodInfo | None,
        node: str | None,
        rate_limit: StreamRateLimit,
        max_pods: int,
        ack_every: int,
        on_change: bool = False,
    ) -> None:
        self._core = core
        self._ignored = metrics.reports_ignored
        self.stream_id = stream_id
        #: A sidecar's pod (None for a DaemonSet agent): the only pod it may report for.
        self.own_pod = own.key if own is not None else None
        #: The uid its hello gave (empty: none): a view of another pod of that name is not sent.
        self._own_uid = own.uid if own is not None else ""
        #: The resource_version of the last view of its pod sent on this stream (None: none).
        self._view_sent: str | None = None
        #: The node a DaemonSet agent's token binds it to (None: not bound, or a sidecar).
        self._node = node
        self._rate_limit = rate_limit
        self._max_pods = max_pods
        self._ack_every = ack_every
        #: An agent that reports on change: its reports are changes already, acked like any.
        self._on_change = on_change
        self._unacked = 0
        #: Every pod this stream has reported for (they lose their agent when it ends).
        self.pods: set[PodKey] = set()

    def message(self) -> Outcome:
        """A message arrived: within the stream's rate, or the stream ends."""
        if self._rate_limit.take():
            return ADMITTED
        return refused(
            Refusal.TOO_FAST,
            f"more than {self._rate_limit.rate} report messages per second on this stream "
            "(--max-reports-per-second)",
        )

    def report(self, key: PodKey, observation: Observation) -> tuple[Outcome, bool]:
        """One validated report: what admission says, and whether it changed the pod's state."""
        if key not in self.pods:
            outcome = new_pod_on_stream(
                key, len(self.pods), self._max_pods, self._node, self._core.pod_info(key)
            )
            if not outcome.admitted:
                return self._skipped(outcome), False
        try:
            changed = self._core.report(self.stream_id, key, observation)
        except NotAdmitted as error:
            return self._skipped(unknown_pod(self.own_pod is not None, str(error))), False
        self.pods.add(key)
        return ADMITTED, changed

    def _skipped(self, outcome: Outcome) -> Outcome:
        if outcome.skip:
            self._ignored.labels(outcome.skip).inc()
            if outcome.message:
                log.debug("ignoring a report: %s", outcome.message)
        return outcome

    def ack_due(self, changed: bool) -> bool:
        """Acks are cumulative: one every ``ack_every`` messages, and, to an agent that sends
        heartbeats, one for a message that changed something (each write costs as much as a
        read; an agent that reports on change sends changes only)."""
        self._unacked += 1
        if (changed and not self._on_change) or self._unacked >= self._ack_every:
            self._unacked = 0
            return True
        return False

    def pod_view(self) -> PodViewFacts | None:
        """A sidecar's pod as the backend knows it, if not sent yet on this stream or changed
        since (another resource_version); None: nothing to send (not a sidecar, a backend that
        watches no pods, the pod not known, or no change)."""
        if self.own_pod is None:
            return None
        view = self._core.pod_view(self.own_pod)
        if view is None or view.resource_version == self._view_sent:
            return None
        if self._own_uid and view.uid != self._own_uid:
            return None
        self._view_sent = view.resource_version
        return view

    def close(self) -> None:
        """The stream ended: its pods have no agent now (the core pulls them)."""
        self._core.goodbye(self.stream_id, self.pods)


class ViewWaiters:
    """The sidecar streams waiting to hear that their pod's view changed (one event each)."""

    def __init__(self) -> None:
        self._events: dict[PodKey, set[asyncio.Event]] = {}

    def open(self, key: PodKey) -> asyncio.Event:
        event = asyncio.Event()
        self._events.setdefault(key, set()).add(event)
        return event

    def close(self, key: PodKey, event: asyncio.Event) -> None:
        events = self._events[key]
        events.discard(event)
        if not events:
            del self._events[key]

    def changed(self, key: PodKey) -> None:
        for event in self._events.get(key, ()):
            event.set()
