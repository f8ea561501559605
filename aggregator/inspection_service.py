"""The read-only InspectionService: the core's query methods, as ``servehealth.v1`` messages.

A drain waits for its calls in flight (:meth:`InspectionService.idle`, at most
``--shutdown-grace``); WatchTransitions ends with UNAVAILABLE when the aggregator stops.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import KW_ONLY, dataclass, field

import grpc

from aggregator.decision import override
from aggregator.decision.core import Core
from aggregator.decision.shadow import ShadowView
from aggregator.decision.tracker import PodRecord
from aggregator.decision.transition_feed import WatcherTooSlow
from aggregator.guard import Guard
from aggregator.ingest import wire
from aggregator.ingest.call_bookkeeping import CallsInFlight
from aggregator.ingest.report_service import SHUTDOWN_MESSAGE
from aggregator.registry import PodRegistry
from servehealth.v1 import servehealth_pb2 as pb
from servehealth.v1 import servehealth_pb2_grpc as pb_grpc
from servehealth_common.override import IN_SERVICE, OUT_OF_SERVICE
from servehealth_common.pod_identity import PodKey
from servehealth_common.states import ServeState

#: The state numbers a pod can be in (ListPodsRequest.states).
POD_STATES = frozenset(int(state) for state in ServeState)


def _state_name(number: int) -> str:
    return pb.ServeState.Name(number) if number in pb.ServeState.values() else str(number)


@dataclass(eq=False)
class InspectionService(pb_grpc.InspectionServiceServicer):
    core: Core
    label_key: str
    wall_clock: Callable[[], float] = time.time
    _: KW_ONLY
    #: --inspection-auth tokenreview: each call must carry a genuine token (None: open).
    guard: Guard | None
    #: Shadow mode and drift: Pod.carried, Summary.dry_run and would_*.
    shadow: ShadowView
    #: Manual overrides: Pod.override, its wanted value and reason; Summary.overridden_*.
    registry: PodRegistry
    _calls: CallsInFlight = field(init=False, default_factory=CallsInFlight)

    async def idle(self) -> None:
        """Until no inspection call is in flight (a drain waits for them)."""
        await self._calls.idle()

    async def _begin(self, context: grpc.aio.ServicerContext) -> None:
        """Every call starts here: counted while in flight, then its token checked."""
        self._calls.started(context)
        if self.guard is not None:
            await self.guard.admit_call(context, "inspection")

    def _clocks(self) -> tuple[float, float]:
        return self.core.now(), self.wall_clock()

    def _pod(self, record: PodRecord, now: float, wall: float) -> pb.Pod:
        message = wire.pod_message(record, now, wall)
        message.carried = self.shadow.carried(record.key)
        view = self.registry.view(record.key)
        if view is not None:  # the kubelet's side (issue 27): a backend that watches pods
            message.kubelet_checks_serve = view.kubelet_checks_serve
            message.kubelet_ready = view.kubelet_ready
        found = self.registry.override(record.key)
        if found.label is not None:  # the probed state stays; the rest says "override"
            message.override = str(found.value)
            message.desired_label = found.label
            message.reason = override.reason(found, record.reason)
        return message

    async def ListPods(
        self, request: pb.ListPodsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPodsResponse:
        await self._begin(context)
        states = set(request.states)
        if unknown := sorted(states - POD_STATES):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"states: {_state_name(unknown[0])} is not a pod state (one of "
                f"{', '.join(_state_name(state) for state in sorted(POD_STATES))})",
            )
        now, wall = self._clocks()
        pods = [
            self._pod(record, now, wall)
            for record in self.core.pods()
            if (not request.namespace or record.key.namespace == request.namespace)
            and (not states or int(record.state) in states)
        ]
        pods.sort(key=lambda pod: (pod.namespace, pod.name))
        return pb.ListPodsResponse(pods=pods)

    async def GetPod(self, request: pb.GetPodRequest, context: grpc.aio.ServicerContext) -> pb.Pod:
        await self._begin(context)
        if not request.namespace or not request.name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "namespace and name are both required"
            )
        record = self.core.pod(PodKey(request.namespace, request.name))
        if record is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pod {request.namespace}/{request.name} is not tracked",
            )
            raise AssertionError("unreachable")  # pragma: no cover - abort raises
        return self._pod(record, *self._clocks())

    async def GetSummary(
        self, request: pb.GetSummaryRequest, context: grpc.aio.ServicerContext
    ) -> pb.Summary:
        await self._begin(context)
        summary = self.core.summary()
        shadow = self.shadow.disagreements()
        overridden = self.registry.overrides()
        return pb.Summary(
            pods=sum(summary.counts.values()),
            pods_by_state={
                pb.ServeState.Name(int(state)): summary.counts[state] for state in ServeState
            },
            agents_connected=summary.agents_connected,
            label_key=self.label_key,
            panic=summary.panic,
            pods_in_pull_mode=summary.pods_in_pull_mode,
            panic_held_writes=summary.panic_held_writes,
            dry_run=self.shadow.dry_run,
            would_enter=shadow.would_enter,
            would_leave=shadow.would_leave,
            overridden_out_of_service=overridden.get(OUT_OF_SERVICE, 0),
            overridden_in_service=overridden.get(IN_SERVICE, 0),
            pods_kubelet_checks_serve=self.registry.pods_kubelet_checks_serve(),
        )

    async def WatchTransitions(
        self, request: pb.WatchTransitionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Transition]:
        await self._begin(context)
        try:
            async for transition in self.core.watch(request.namespace):
                yield wire.transition_message(transition, *self._clocks())
        except WatcherTooSlow as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        # The feed ends only when the aggregator stops (Core.close_watchers): say so, as a
        # drained Report stream does, rather than end with OK like a finished answer.
        await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
