"""Keeps each pod's serve label (and, in condition mode, its readiness condition) equal to
what it should carry, with as few API writes as possible and through any API trouble.

Level-triggered, as controller-runtime and kopf reconcile: the registry says only *which pod*
may need a write (:meth:`Writer.enqueue`: a transition, a watch event, an override, the end of
PANIC, a restart's list all come here the same way); a worker that takes the pod asks the
registry what it should carry now (:meth:`PodStates.desired`, the one
:func:`servehealth_common.pod_writes.desired.desired`) and writes the difference from what it
carries. Nothing is remembered of what was wanted earlier: many changes of a pod before a
worker is free are one write, of the latest.

- Pods wait in one keyed queue (:class:`servehealth_common.work_queue.KeyedQueue`): queued
  once however often they change, one worker per pod at a time (its label and its condition
  one after the other), retried per pod with the queue's backoff.
- A write happens only when :func:`servehealth_common.pod_writes.rule.write_needed` says so,
  checked again just before each request (the pod may have changed while the write waited).
- Every request takes a token from one client-side bucket (``qps``/``burst``): the Python client
  has no limiter of its own.
- 429, 5xx, timeouts and broken connections are retried with the queue's backoff (capped, full
  jitter), honouring ``Retry-After``; a write is never dropped for them. 404 means the pod is
  gone: forget it. 409 re-reads the pod and tries again.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from aiolimiter import AsyncLimiter

from aggregator.kube.api import KubeApi
from aggregator.metrics import Metrics
from servehealth_common import fallback_marks
from servehealth_common.kube.errors import APIConflictError, APIError, APINotFoundError
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.bodies import condition_patch, label_patch
from servehealth_common.pod_writes.desired import Desired
from servehealth_common.pod_writes.rule import WriteKind, condition_fields
from servehealth_common.pod_writes.times import utc_now
from servehealth_common.work_queue import KeyedQueue

log = logging.getLogger(__name__)

Target = tuple[PodKey, WriteKind]


@dataclass(frozen=True, slots=True)
class WriterSettings:
    label_key: str
    condition_type: str
    qps: float
    burst: int
    concurrency: int


class PodStates(Protocol):
    """The registry, as the writer reads and updates it: what each pod should carry, and its
    copy of what the pod carries."""

    def desired(self, key: PodKey) -> Desired:
        """What ``key`` should carry now (nothing, for a pod not known)."""

    def marked(self, key: PodKey) -> bool:
        """Whether the pod carries the annotation of an agent's fallback write of the label."""

    def written(self, key: PodKey, kind: WriteKind, value: str, body: dict[str, Any]) -> None:
        """A write of ``value`` succeeded; ``body`` is the API's answer (the pod as written)."""

    async def refresh(self, key: PodKey) -> None:
        """Read the pod again (after a 409)."""


class WriteOutcome(enum.Enum):
    """How one write attempt of a target ended (a failure worth retrying: its ``APIError``)."""

    DONE = "done"  # written, or nothing to write
    AGAIN = "again"  # a 409: the pod was re-read and is queued again
    GONE = "gone"  # a 404: the pod is forgotten


class Writer:
    """The aggregator's pod writer: pods that may need a write (:meth:`enqueue`) in a
    :class:`~servehealth_common.work_queue.KeyedQueue`, whose workers compare what each should
    carry with what it carries and write the difference."""

    def __init__(
        self,
        api: KubeApi,
        settings: WriterSettings,
        metrics: Metrics,
        pods: PodStates,
    ) -> None:
        self._api = api
        self.settings = settings
        self._metrics = metrics
        self._pods = pods
        self.limiter = AsyncLimiter(settings.burst, settings.burst / settings.qps)
        self._queue: KeyedQueue[PodKey] = KeyedQueue()
        #: When each target was first seen to need a write (serve_health_write_delay_seconds).
        self._since: dict[Target, float] = {}

    # -- what the registry calls --------------------------------------------------------

    def enqueue(self, key: PodKey, wanted: Desired) -> None:
        """``key`` changed (what it carries, or what it should): queue it if ``wanted``, what
        it should carry now, differs from what it carries."""
        now = time.monotonic()
        for kind in wanted.writes:
            self._since.setdefault((key, kind), now)
        if wanted.writes:
            self._queue.add(key)

    def forget(self, key: PodKey) -> None:
        for kind in WriteKind:
            self._since.pop((key, kind), None)
        self._queue.drop(key)

    def pending_for(self, key: PodKey) -> bool:
        """Whether a write of ``key`` is queued, in flight or waiting to retry."""
        return key in self._queue

    @property
    def pending(self) -> int:
        """Pods with a write queued, in flight or waiting to retry."""
        return len(self._queue)

    # -- the work -----------------------------------------------------------------------

    async def run(self) -> None:
        await self._queue.serve(self._reconcile, workers=self.settings.concurrency, name="writer")

    async def _reconcile(self, key: PodKey) -> None:
        """Make ``key`` carry what it should: each target on its own (a label refused does not
        keep the condition from being written); the pod again after its backoff if a write
        failed."""
        failed: list[APIError] = []
        again = False
        for kind in WriteKind:
            outcome = await self._reconcile_target(key, kind)
            if outcome is WriteOutcome.GONE:
                return
            if isinstance(outcome, APIError):
                failed.append(outcome)
            again |= outcome is WriteOutcome.AGAIN
        if failed:
            self._retry(key, failed)
        elif not again:
            self._queue.forget(key)

    def _needed(self, key: PodKey, kind: WriteKind) -> tuple[str, str] | None:
        """The value (and the condition's message) ``kind`` of ``key`` should be written with
        now; None when it carries that already (or nothing is wanted)."""
        wanted = self._pods.desired(key)
        if kind not in wanted.writes:
            self._since.pop((key, kind), None)
            return None
        value = wanted.label if kind is WriteKind.LABEL else wanted.condition
        assert value is not None
        return value, wanted.message or ""

    async def _reconcile_target(self, key: PodKey, kind: WriteKind) -> WriteOutcome | APIError:
        """One write attempt of ``kind`` of ``key``, if it does not carry what it should."""
        if self._needed(key, kind) is None:
            return WriteOutcome.DONE
        await self.limiter.acquire()
        needed = self._needed(key, kind)  # the bucket may have made us wait; look again
        if needed is None:
            return WriteOutcome.DONE
        value, message = needed
        try:
            pod = await self._send(key, kind, value, message)
        except APINotFoundError:
            self._metrics.label_writes.labels(kind.value, "not_found").inc()
            log.info("pod %s is gone; dropping its %s write", key, kind.value)
            self.forget(key)
            return WriteOutcome.GONE
        except APIConflictError as error:
            self._metrics.label_writes.labels(kind.value, "conflict").inc()
            log.info("%s; re-reading the pod", error)
            with contextlib.suppress(APIError):
                await self._pods.refresh(key)
            self._queue.add(key)  # at once, on the pod as it is now
            return WriteOutcome.AGAIN
        except APIError as error:
            self._metrics.label_writes.labels(kind.value, "error").inc()
            self._metrics.api_retries.labels(str(error.status or "transport")).inc()
            return error
        self._metrics.label_writes.labels(kind.value, "success").inc()
        self._pods.written(key, kind, value, pod)
        since = self._since.pop((key, kind), None)
        if since is not None:
            self._metrics.write_delay.labels(kind.value).observe(time.monotonic() - since)
        return WriteOutcome.DONE

    def _retry(self, key: PodKey, failed: list[APIError]) -> None:
        """Queue ``key`` for its retry (the longest ``Retry-After`` of its failures, else its
        backoff), and log each failure."""
        asked = [error.retry_after for error in failed if error.retry_after is not None]
        delay = self._queue.retry(key, max(asked) if asked else None)
        attempt = self._queue.failures(key)
        for error in failed:
            level = logging.WARNING if error.retryable else logging.ERROR
            log.log(level, "%s (attempt %d, retrying in %.2fs)", error, attempt, delay)

    async def _send(self, key: PodKey, kind: WriteKind, value: str, message: str) -> dict[str, Any]:
        if kind is WriteKind.LABEL:
            # If an agent in fallback wrote the label last, its mark (the annotation) goes: the
            # label is no longer the agent's write, and is not counted again at the next
            # take-over or restart.
            removed = {fallback_marks.ANNOTATION: None} if self._pods.marked(key) else None
            body = label_patch(self.settings.label_key, value, annotations=removed)
            return await self._api.patch_pod(key, body)
        status, reason = condition_fields(value)
        body = condition_patch(self.settings.condition_type, status, reason, message, utc_now())
        return await self._api.patch_pod_status(key, body)
