"""Leader election on a ``coordination.k8s.io/v1`` Lease, modelled on client-go's
``tools/leaderelection`` (``tryAcquireOrRenew``), with the clock, the wall clock and the sleep
injected so that the decisions can be tested without time passing.

The rules, for a candidate with identity ``me``:

- no Lease: create one naming ``me`` (409 AlreadyExists: another candidate won the race);
- a Lease with an empty holder (released), or one whose record has not changed, *as this
  process observed it*, for the record's ``leaseDurationSeconds``: take it over with an update
  conditional on the resourceVersion just read (409: another candidate won the race). Expiry is
  measured from when this process last saw the record change, never from the ``renewTime``
  written in it, so clock skew between replicas does not matter (only clock *rates* do);
- a Lease held by another holder and not expired: stay a standby, look again later.

The leader renews every ``retry_period`` with an update carrying the resourceVersion of its
last write (a 409 means someone else wrote it since: read it again and decide). If no renewal
succeeds for ``renew_deadline`` (counted from when the last successful one was *sent*), or the
Lease is seen naming someone else, leadership is lost. ``renew_deadline < lease_duration``:
the leader gives up before any standby may take over. ``release()`` (graceful stop) writes an
empty holder with ``leaseDurationSeconds: 1`` so that a standby takes over at once, as
client-go's ``ReleaseOnCancel``; the caller must stop every guarded write before calling it.

Nothing here imports the Kubernetes client: the Lease is reached through a :class:`LeaseStore`
(``aggregator/leader/lease.py`` for the API, a dict in the unit tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol, TypeVar

from servehealth_common.backoff import jittered
from servehealth_common.kube.errors import APIConflictError, APIError
from servehealth_common.pod_writes.times import micro_time, utc_now

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Wake this much after the moment a lease is due to expire (timers may fire a hair early).
EXPIRY_MARGIN = 0.005


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The election part of a Lease's spec."""

    holder: str
    duration_seconds: int
    acquire_time: str = ""
    renew_time: str = ""
    transitions: int = 0


@dataclass(frozen=True, slots=True)
class Lease:
    record: LeaseRecord
    version: str  # metadata.resourceVersion


class LeaseStore(Protocol):
    """Where the Lease lives. Failures raise :mod:`servehealth_common.kube.errors` (409:
    :class:`APIConflictError`). The elector abandons any call after its own deadline; the
    store's requests should carry one no longer than :attr:`ElectionSettings.call_timeout`."""

    def describe(self) -> str:
        """``namespace/name``, for logs."""

    async def get(self) -> Lease | None:
        """The Lease, or None if there is none."""

    async def create(self, record: LeaseRecord) -> str:
        """Create the Lease; its resourceVersion. 409 if it exists."""

    async def update(self, record: LeaseRecord, version: str) -> str:
        """Replace the Lease's record if it is still at ``version``; the new resourceVersion.
        409 if it is not."""


@dataclass(frozen=True, slots=True)
class ElectionSettings:
    """Timings of the election (validated with the flags in ``aggregator/settings.py``)."""

    lease_duration: int  # whole seconds: the Lease stores leaseDurationSeconds
    renew_deadline: float
    retry_period: float

    @property
    def call_timeout(self) -> float:
        """Deadline of one API call: two attempts fit in the renew deadline."""
        return self.renew_deadline / 2


class LeaderElector:
    """One candidate. ``await acquire()`` returns once it leads; ``await hold()`` renews and
    returns the reason when leadership is lost; ``await release()`` gives the Lease up."""

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        settings: ElectionSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = utc_now,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        on_renew_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.identity = identity
        self.settings = settings
        self._clock = clock
        self._wall = wall
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._on_renew_failure = on_renew_failure
        #: The record last seen (read, or written by this candidate), and when it last changed.
        self.observed: LeaseRecord | None = None
        self.observed_at = float("-inf")
        self._version: str | None = None  # resourceVersion of ``observed``
        #: When the last successful acquire or renew was sent (the renew deadline counts
        #: from here).
        self.renewed_at: float | None = None
        self._reported_leader: str | None = None
        #: The record last taken over (None: created it): when the previous leader last renewed.
        self.previous: LeaseRecord | None = None
        #: Whether a write of the Lease went unanswered (timed out, or cancelled by a stop): it
        #: may have landed, so the Lease may name this candidate though it does not know it.
        self._unanswered = False
        #: Failed Lease calls in a row, and the kind of the latest (logged once per kind).
        self._failures = 0
        self._failing = ""

    # -- state --------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.observed is not None and self.observed.holder == self.identity

    @property
    def leader(self) -> str:
        """The holder last seen ("" if none)."""
        return self.observed.holder if self.observed is not None else ""

    def lease_valid(self, now: float) -> bool:
        """Whether the observed record has changed within its own lease duration."""
        return self.observed is not None and self.observed_at + self.observed.duration_seconds > now

    def _observe(self, record: LeaseRecord, version: str) -> None:
        if record != self.observed:
            self.observed = record
            self.observed_at = self._clock()
        self._version = version

    # -- one attempt (client-go's tryAcquireOrRenew) --------------------------------------

    async def try_acquire_or_renew(self, call_timeout: float) -> bool:
        """One attempt to acquire or renew; True if this candidate holds the Lease now.

        Each API call gets ``call_timeout``. Errors are logged and answer False.
        """
        started = self._clock()
        now = micro_time(self._wall())
        duration = self.settings.lease_duration
        describe = self.store.describe()
        # 1. Fast path: the leader renews what it wrote last, without reading first.
        if self.is_leader and self.lease_valid(started) and self._version is not None:
            assert self.observed is not None
            record = replace(self.observed, duration_seconds=duration, renew_time=now)
            try:
                renewal = self.store.update(record, self._version)
                version = await self._bounded(renewal, call_timeout)
            except (APIError, TimeoutError) as error:
                log.debug("optimistic renewal of lease %s failed (%s); reading it", describe, error)
            else:
                self._observe(record, version)
                self.renewed_at = started
                self._answered()
                return True
        # 2. Read it (create it if there is none).
        try:
            lease = await self._bounded(self.store.get(), call_timeout)
        except (APIError, TimeoutError) as error:
            self._failed("read", error)
            return False
        self._answered()
        if lease is None:
            record = LeaseRecord(self.identity, duration, now, now, 0)
            return await self._write(record, None, started, call_timeout)
        # 3. Someone else's and not expired (by this process's observation): keep waiting.
        self._observe(lease.record, lease.version)
        if lease.record.holder and self.lease_valid(self._clock()) and not self.is_leader:
            return False
        # 4. Ours (renew) or free/expired (take over), conditional on the version just read.
        if self.is_leader:
            record = replace(lease.record, duration_seconds=duration, renew_time=now)
        else:
            record = LeaseRecord(self.identity, duration, now, now, lease.record.transitions + 1)
            self.previous = lease.record
        return await self._write(record, lease.version, started, call_timeout)

    async def _write(
        self, record: LeaseRecord, read: str | None, started: float, call_timeout: float
    ) -> bool:
        """Create the Lease (``read`` None: there was none) or update it from version ``read``,
        with ``record``; True if written (this candidate holds it, from ``started`` on). A 409
        means another candidate won: False, as any error."""
        if read is None:
            action, conflict = "create", "was created by another candidate first"
            call = self.store.create(record)
        else:
            action, conflict = "update", "changed while this candidate wrote it (409)"
            call = self.store.update(record, read)
        self._unanswered = True
        try:
            version = await self._bounded(call, call_timeout)
        except APIConflictError:
            self._unanswered = False
            log.info("lease %s %s", self.store.describe(), conflict)
            return False
        except (APIError, TimeoutError) as error:
            self._failed(action, error)
            return False
        self._unanswered = False
        self._observe(record, version)
        self.renewed_at = started
        return True

    def _failed(self, action: str, error: BaseException) -> None:
        """A Lease call failed: a WARNING when failures start or change kind (HTTP status, no
        answer, timeout), each repeat at debug level (a standby polls for as long as the API
        server is away)."""
        self._failures += 1
        kind = f"cannot {action} lease {self.store.describe()}: {_kind(error)}"
        if kind == self._failing:
            log.debug("%s (%s; failed attempt %d)", kind, _why(error), self._failures)
            return
        was = f"; was: {self._failing}" if self._failing else ""
        self._failing = kind
        log.warning(
            "cannot %s lease %s: %s (failed attempt %d%s; logged again when this changes or "
            "ends, each attempt at debug level)",
            action,
            self.store.describe(),
            _why(error),
            self._failures,
            was,
        )

    def _answered(self) -> None:
        """A Lease call was answered: the end of the failures, if any (logged)."""
        if self._failures:
            log.info(
                "lease %s answers again, after %d failed attempts (last: %s)",
                self.store.describe(),
                self._failures,
                self._failing,
            )
        self._failures, self._failing = 0, ""

    @staticmethod
    async def _bounded(call: Coroutine[Any, Any, T], seconds: float) -> T:
        """The call, abandoned after ``seconds`` (TimeoutError) whatever the client does."""
        async with asyncio.timeout(seconds):
            return await call

    # -- loops --------------------------------------------------------------------------

    async def acquire(self) -> None:
        """Try every ``retry_period`` (jittered) until this candidate leads; then return.

        A standby that sees a lease about to expire wakes when it does, not a period later.
        """
        describe = self.store.describe()
        log.info("leader election: attempting to acquire lease %s as %s", describe, self.identity)
        while True:
            if await self.try_acquire_or_renew(self.settings.call_timeout):
                log.info("leader election: %s acquired lease %s", self.identity, describe)
                self._reported_leader = self.identity
                return
            self._report_leader()
            await self._sleep(self._next_attempt_in())

    def _next_attempt_in(self) -> float:
        wait = jittered(self.settings.retry_period, self._rng)
        if self.observed is not None and self.observed.holder:
            expires_in = self.observed_at + self.observed.duration_seconds - self._clock()
            if expires_in > 0:
                wait = min(wait, expires_in + EXPIRY_MARGIN)
        return wait

    def _report_leader(self) -> None:
        leader = self.leader
        if leader != self._reported_leader:
            self._reported_leader = leader
            log.info(
                "leader election: lease %s is held by %s",
                self.store.describe(),
                leader or "nobody (released)",
            )

    async def hold(self) -> str:
        """Renew every ``retry_period`` until leadership is lost; returns why.

        Lost when no renewal succeeded within ``renew_deadline`` of the last successful one,
        or when the Lease names another holder.
        """
        if not self.is_leader or self.renewed_at is None:
            return "not the leader"
        settings = self.settings
        last_attempt = self.renewed_at
        while True:
            deadline = self.renewed_at + settings.renew_deadline
            now = self._clock()
            wake = min(last_attempt + settings.retry_period, deadline)
            if wake > now:
                await self._sleep(wake - now)
                now = self._clock()
            if now >= deadline:
                return (
                    f"could not renew lease {self.store.describe()} within the renew deadline "
                    f"({settings.renew_deadline:g}s)"
                )
            last_attempt = now
            attempt = self.try_acquire_or_renew(min(settings.call_timeout, deadline - now))
            try:
                renewed = await self._bounded(attempt, deadline - now)
            except TimeoutError:
                renewed = False
            if renewed:
                continue
            self._on_renew_failure()
            if not self.is_leader:
                return f"lease {self.store.describe()} is now held by {self.leader or 'nobody'}"

    async def release(self) -> bool:
        """Give the Lease up (empty holder, ``leaseDurationSeconds: 1``) if this candidate
        holds it, or may (a write of it went unanswered: a stop that cancelled an acquire
        after it landed); True if released. Stop every guarded write first."""
        if not (self.is_leader and self._version is not None) and not self._unanswered:
            return False
        try:
            released = await self._release(self.settings.call_timeout)
        except (APIError, TimeoutError) as error:
            log.warning("cannot release lease %s: %s", self.store.describe(), _why(error))
            return False
        if released is None:
            log.info("lease %s is no longer held by %s", self.store.describe(), self.identity)
            return False
        self._observe(*released)
        self._unanswered = False
        log.info("leader election: %s released lease %s", self.identity, self.store.describe())
        return True

    async def _release(self, seconds: float) -> tuple[LeaseRecord, str] | None:
        """The released record and its version; None if the Lease names someone else."""
        if self.is_leader and self.observed is not None and self._version is not None:
            with contextlib.suppress(APIConflictError):
                return await self._release_from(self.observed, self._version, seconds)
        # A renewal or an acquire whose answer never came may have landed after all: if the
        # Lease names this candidate, release it at its current version.
        lease = await self._bounded(self.store.get(), seconds)
        if lease is None or lease.record.holder != self.identity:
            return None
        return await self._release_from(lease.record, lease.version, seconds)

    async def _release_from(
        self, held: LeaseRecord, version: str, seconds: float
    ) -> tuple[LeaseRecord, str]:
        now = micro_time(self._wall())
        record = LeaseRecord("", 1, now, now, held.transitions)
        return record, await self._bounded(self.store.update(record, version), seconds)


def _why(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _kind(error: BaseException) -> str:
    if isinstance(error, APIError):
        return f"HTTP {error.status}" if error.status else "no answer"
    return "no answer in time" if isinstance(error, TimeoutError) else type(error).__name__
