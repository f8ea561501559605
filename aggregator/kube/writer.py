"""Keeps each pod's serve label (and, in condition mode, its readiness condition) equal to
what the core wants, with as few API writes as possible and through any API trouble.

- A write happens only when :func:`servehealth_common.pod_writes.rule.write_needed` says so, checked
  again just before each request (the pod may have changed while the write waited).
- Targets (pod, kind) wait in one keyed queue (:class:`servehealth_common.work_queue.KeyedQueue`):
  at most one write per target is in flight; a newer wanted value replaces a queued one (the
  queue holds the target, the value is looked up when a worker takes it), and a value that
  became true again before its write is dropped unwritten.
- Every request takes a token from one client-side bucket (``qps``/``burst``): the Python client
  has no limiter of its own.
- 429, 5xx, timeouts and broken connections are retried with the queue's backoff per target
  (capped, full jitter), honouring ``Retry-After``; a write is never dropped for them. 404
  means the pod is gone: forget it. 409 re-reads the pod and tries again.
"""

from __future__ import annotations

import contextlib
import logging
import random
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
from servehealth_common.pod_writes.rule import WriteKind, condition_fields, write_needed
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


class PodCopies(Protocol):
    """The registry's copy of each pod, as the writer reads and updates it."""

    def carried(self, key: PodKey, kind: WriteKind) -> str | None:
        """What the pod carries now for ``kind`` (None: absent)."""

    def marked(self, key: PodKey) -> bool:
        """Whether the pod carries the annotation of an agent's fallback write of the label."""

    def written(self, key: PodKey, kind: WriteKind, value: str, body: dict[str, Any]) -> None:
        """A write of ``value`` succeeded; ``body`` is the API's answer (the pod as written)."""

    async def refresh(self, key: PodKey) -> None:
        """Read the pod again (after a 409)."""


class Writer:
    """The aggregator's pod writer: what each target should say (:meth:`want`), and a
    :class:`~servehealth_common.work_queue.KeyedQueue` of targets whose workers compare it with
    what the pod carries and write the difference."""

    def __init__(
        self,
        api: KubeApi,
        settings: WriterSettings,
        metrics: Metrics,
        pods: PodCopies,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._api = api
        self.settings = settings
        self._metrics = metrics
        self._pods = pods
        self.limiter = AsyncLimiter(settings.burst, settings.burst / settings.qps)
        self._queue: KeyedQueue[Target] = KeyedQueue(rng=rng)
        self._wanted: dict[Target, tuple[str, str]] = {}  # value, message
        #: When each pending target was first wanted (for serve_health_write_delay_seconds).
        self._since: dict[Target, float] = {}

    # -- what the registry calls --------------------------------------------------------

    def want(self, key: PodKey, kind: WriteKind, value: str, message: str | None = None) -> bool:
        """Make ``kind`` of ``key`` say ``value``; ``message`` (conditions) None keeps the one
        already wanted for that same value (a message wanted with another value described
        that one: an override's, say, removed before its write was sent). True if a write is
        now pending for it (False: nothing to write)."""
        target = (key, kind)
        pending = self._wanted.get(target)
        if pending is None and not write_needed(kind, self._pods.carried(key, kind), value):
            return False
        if message is None:
            message = pending[1] if pending is not None and pending[0] == value else ""
        if pending is None:
            self._since[target] = time.monotonic()
        self._wanted[target] = (value, message)
        self._queue.add(target)
        return True

    def forget(self, key: PodKey) -> None:
        for kind in WriteKind:
            target = (key, kind)
            self._wanted.pop(target, None)
            self._since.pop(target, None)
            self._queue.drop(target)

    @property
    def pending(self) -> int:
        """Targets waiting for a write (queued, in flight or waiting to retry)."""
        return len(self._wanted)

    # -- the work -----------------------------------------------------------------------

    async def run(self) -> None:
        workers = self.settings.concurrency
        await self._queue.serve(self._write_if_needed, workers=workers, name="writer")

    def _settled(self, target: Target) -> bool:
        """True (and the target dropped) when the pod already carries the wanted value."""
        wanted = self._wanted.get(target)
        if wanted is None:
            return True
        if not write_needed(target[1], self._pods.carried(*target), wanted[0]):
            del self._wanted[target]
            self._queue.forget(target)
            self._since.pop(target, None)
            return True
        return False

    async def _write_if_needed(self, target: Target) -> None:
        """One write attempt for ``target``, if the pod does not carry what is wanted; a
        failure worth retrying puts the target back in the queue after its backoff."""
        if self._settled(target):
            return
        await self.limiter.acquire()
        if self._settled(target):  # the bucket may have made us wait; look again
            return
        key, kind = target
        value, message = self._wanted[target]
        try:
            pod = await self._send(key, kind, value, message)
        except APINotFoundError:
            self._metrics.label_writes.labels(kind.value, "not_found").inc()
            log.info("pod %s is gone; dropping its %s write", key, kind.value)
            self.forget(key)
            return
        except APIConflictError as error:
            self._metrics.label_writes.labels(kind.value, "conflict").inc()
            log.info("%s; re-reading the pod", error)
            with contextlib.suppress(APIError):
                await self._pods.refresh(key)
            self._queue.add(target)  # at once, on the pod as it is now
            return
        except APIError as error:
            self._metrics.label_writes.labels(kind.value, "error").inc()
            self._metrics.api_retries.labels(str(error.status or "transport")).inc()
            if target not in self._wanted:
                return  # forgotten meanwhile (the pod is gone)
            delay = self._queue.retry(target, error.retry_after)
            level = logging.WARNING if error.retryable else logging.ERROR
            attempt = self._queue.failures(target)
            log.log(level, "%s (attempt %d, retrying in %.2fs)", error, attempt, delay)
            return
        self._metrics.label_writes.labels(kind.value, "success").inc()
        self._queue.forget(target)
        self._pods.written(key, kind, value, pod)
        if self._wanted.get(target, (None,))[0] == value:
            del self._wanted[target]
            since = self._since.pop(target, None)
            if since is not None:
                self._metrics.write_delay.labels(kind.value).observe(time.monotonic() - since)

    def _label_body(self, key: PodKey, value: str) -> dict[str, Any]:
        """The label; and, if an agent in fallback wrote it last, the removal of its mark (the
        annotation): it is no longer the agent's write, and is not counted again at the next
        take-over or restart."""
        removed = {fallback_marks.ANNOTATION: None} if self._pods.marked(key) else None
        return label_patch(self.settings.label_key, value, annotations=removed)

    async def _send(self, key: PodKey, kind: WriteKind, value: str, message: str) -> dict[str, Any]:
        if kind is WriteKind.LABEL:
            return await self._api.patch_pod(key, self._label_body(key, value))
        status, reason = condition_fields(value)
        body = condition_patch(self.settings.condition_type, status, reason, message, utc_now())
        return await self._api.patch_pod_status(key, body)
