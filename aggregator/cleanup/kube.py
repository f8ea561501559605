"""``serve-health-cleanup`` on the Kubernetes API: read the Ray pods, look at the aggregator's
Lease, and send the changes :mod:`aggregator.cleanup.rules` decides (or only print them, with
``--dry-run``).

Every request goes through :class:`~aggregator.kube.api.KubeApi` (bounded thread pool, a
deadline on each call, errors from :mod:`servehealth_common.kube.errors`) and one client-side
token bucket, as the aggregator's writer does. 429, 5xx, timeouts, broken connections and 409s
are retried with the writer's backoff (:func:`servehealth_common.backoff.backoff_delay`,
honouring ``Retry-After``) up to ``max_attempts`` attempts; a 404 means the pod was deleted
meanwhile (counted as gone, not as a failure); any other error fails that pod and the others go
on.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiolimiter import AsyncLimiter

from aggregator.cleanup.rules import Change, CleanupRules, PodPlan, patch_of, plan
from aggregator.kube.api import KubeApi
from aggregator.leader.elector import LeaseStore
from servehealth_common.backoff import backoff_delay, retry_delay
from servehealth_common.kube.errors import APIConflictError, APIError, APINotFoundError
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.times import api_time, utc_now

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CleanupSettings:
    """The cleanup's flags that this part reads (named as the flags)."""

    namespace: tuple[str, ...]  # empty: every namespace
    pod_selector: str
    dry_run: bool
    kube_qps: float
    kube_burst: int
    kube_concurrency: int


class CleanupOutcome(enum.Enum):
    CHANGED = "changed"
    RIGHT = "already right"
    FAILED = "failed"
    GONE = "gone"


class Tally(collections.Counter[CleanupOutcome]):
    """Pods by outcome."""

    @property
    def failed(self) -> int:
        return self[CleanupOutcome.FAILED]

    def summary(self, dry_run: bool) -> str:
        changed = "would change" if dry_run else "changed"
        return (
            f"summary: {self.total()} pods: {self[CleanupOutcome.CHANGED]} {changed}, "
            f"{self[CleanupOutcome.RIGHT]} already right, {self.failed} failed, "
            f"{self[CleanupOutcome.GONE]} gone (deleted meanwhile)"
            + (" (dry run: nothing was changed)" if dry_run else "")
        )


@dataclass
class Retrier:
    """Retries one call on the errors worth retrying, with the aggregator writer's backoff."""

    max_attempts: int
    rng: random.Random = field(default_factory=random.Random)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    def delay(self, error: APIError, attempt: int) -> float:
        return retry_delay(error.retry_after, lambda: backoff_delay(attempt - 1, self.rng))

    async def call(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, again after a backoff while it fails with an error worth retrying;
        the last error after ``max_attempts`` (errors say what failed: no context added)."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await call()
            except APIError as error:
                worth = error.retryable or isinstance(error, APIConflictError)
                if not worth or attempt == self.max_attempts:
                    raise
                delay = self.delay(error, attempt)
                log.warning(
                    "%s (attempt %d/%d, retrying in %.2fs)",
                    error,
                    attempt,
                    self.max_attempts,
                    delay,
                )
                await self.sleep(delay)
        raise AssertionError("unreachable: max_attempts is at least 1")


async def live_holder(
    store: LeaseStore,
    retrier: Retrier,
    *,
    watch: bool = True,
    poll: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> str:
    """Who holds the aggregator's Lease and is alive; "" when nobody does.

    Nobody: no Lease, an empty holder (released, as the aggregator does on SIGTERM), or, with
    ``watch``, a record that did not change while watched for its ``leaseDurationSeconds``:
    expiry is judged by observation, as :mod:`aggregator.leader.elector`'s candidates do, never by
    the ``renewTime`` written in it (clocks differ). Without ``watch``: whoever the Lease names.
    """
    lease = await retrier.call(store.get)
    if lease is None or not lease.record.holder:
        return ""
    if not watch:
        return lease.record.holder
    first = lease.record
    until = clock() + first.duration_seconds + poll
    while (left := until - clock()) > 0:
        await sleep(min(poll, left))
        lease = await retrier.call(store.get)
        if lease is None or not lease.record.holder:
            return ""
        if lease.record != first:
            return lease.record.holder  # renewed (or taken over) while watched: alive
    log.info(
        "lease %s names %s but was not renewed for its %ds: expired",
        store.describe(),
        first.holder,
        first.duration_seconds,
    )
    return ""


async def last_renewal(store: LeaseStore, retrier: Retrier) -> str:
    """The ``renewTime`` of the aggregator's Lease: when an aggregator last renewed it, or
    released it ("": no Lease, none written, or it cannot be read: the error is logged)."""
    try:
        lease = await retrier.call(store.get)
    except APIError as error:
        log.warning("cannot read %s: %s", store.describe(), error)
        return ""
    return lease.record.renew_time if lease is not None else ""


class Cleaner:
    """Lists the Ray pods and applies each pod's plan; ``out`` gets one line per change (and
    what is left alone), to be printed."""

    def __init__(
        self,
        api: KubeApi,
        rules: CleanupRules,
        settings: CleanupSettings,
        out: Callable[[str], None],
        retrier: Retrier,
    ) -> None:
        self._api = api
        self.rules = rules
        self.settings = settings
        self._out = out
        self._retrier = retrier
        self._limiter = AsyncLimiter(settings.kube_burst, settings.kube_burst / settings.kube_qps)
        self._slots = asyncio.Semaphore(settings.kube_concurrency)

    async def pods(self) -> list[dict[str, Any]]:
        """Every pod the selector matches, in the namespaces asked for (all: none given)."""
        found: list[dict[str, Any]] = []
        for namespace in self.settings.namespace or (None,):
            list_pods = functools.partial(
                self._api.list_pods, namespace, self.settings.pod_selector
            )
            items, _ = await self._retrier.call(list_pods)
            found += items
        return found

    async def apply(self, pods: list[dict[str, Any]]) -> Tally:
        """Clean these pods up (as :meth:`pods` listed them)."""
        return Tally(await asyncio.gather(*(self._apply(p) for p in plan(pods, self.rules))))

    async def _apply(self, pod: PodPlan) -> CleanupOutcome:
        for kept in pod.kept:
            self._out(f"{pod.key}: left alone: {kept}")
        if not pod.changes:
            log.debug("%s: already right", pod.key)
            return CleanupOutcome.RIGHT
        if self.settings.dry_run:
            for change in pod.changes:
                self._out(f"{pod.key}: would {change.describe()}")
            return CleanupOutcome.CHANGED
        failed = False
        async with self._slots:
            for change in pod.changes:
                try:
                    await self._retrier.call(functools.partial(self._send, pod.key, change))
                except APINotFoundError:
                    self._out(f"{pod.key}: gone (deleted meanwhile); nothing to clean up")
                    return CleanupOutcome.GONE
                except APIError as error:
                    log.error("%s: cannot %s: %s", pod.key, change.describe(), error)
                    self._out(f"{pod.key}: FAILED to {change.describe()}")
                    failed = True
                    continue
                self._out(f"{pod.key}: {change.describe()}")
        return CleanupOutcome.FAILED if failed else CleanupOutcome.CHANGED

    async def _send(self, key: PodKey, change: Change) -> dict[str, Any]:
        await self._limiter.acquire()
        body = patch_of(change, api_time(utc_now()))
        if change.op.on_status:
            return await self._api.patch_pod_status(key, body)
        return await self._api.patch_pod(key, body)
