"""The agent's fallback writes on the Kubernetes API: the aggregator's bodies, plus the marks of
an agent's write (:mod:`servehealth_common.fallback_marks`), an Event each, one log line each.

- label: a JSON merge patch of ``metadata.labels[<key>]`` and the annotation
  ``ray-serve-health/fallback-write: <RFC 3339 time, with microseconds> <agent>``;
- condition: a strategic merge patch of ``pods/status`` with the condition (type, status,
  reason ``NoAggregator``, a message naming the agent, lastTransitionTime now);
- then an Event on the pod (reason ``NoAggregator``; Normal into service, Warning out of it).

Each call has the client's deadline (``--kube-timeout``). The pods to write wait in the keyed
queue both programs write from (:class:`servehealth_common.work_queue.KeyedQueue`: a pod is
queued once, one worker per pod at a time). Level-triggered, as the aggregator's writer: a
worker asks the decider what the pod should be written now
(:meth:`~node_agent.fallback.decider.Fallback.next_write`) when it takes the pod and again once
its slot of the API budget comes, so a stream accepted meanwhile, an override or a change of
the probes' mind is never written over. 429, 5xx, 409 and broken connections are retried with
the queue's backoff per pod (capped, full jitter; ``Retry-After`` honoured); 404 means the pod
is gone; anything else (a 403: no RBAC for it) is given up until the next fallback. A failing
write is logged when its failure starts and when it changes or ends (with the number of
attempts), not at every attempt.

This module imports the Kubernetes client: a sidecar loads it only when fallback begins.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from node_agent.fallback.bodies import event_body, write_body
from node_agent.fallback.decider import Fallback, FallbackPhase
from node_agent.fallback.lease_gate import LeaseName
from node_agent.fallback.lease_watch import follow_lease
from node_agent.fallback.ports import LeaseListener
from node_agent.fallback.rules import PodFacts, Write
from node_agent.flags import AgentFlags
from node_agent.kube_client import make_kube_client
from node_agent.sink import MetricsSink
from servehealth_common import fallback_marks as marks
from servehealth_common.backoff import RETRY_CAP, RETRY_FLOOR, Backoff, retry_delay
from servehealth_common.kube.client import KubeClient, NoKubeConfig
from servehealth_common.kube.errors import APIError, APIForbiddenError, APINotFoundError
from servehealth_common.kube.watch import PodWatch
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.rule import WriteKind
from servehealth_common.pod_writes.times import utc_now
from servehealth_common.work_queue import KeyedQueue

log = logging.getLogger(__name__)

#: Writes in flight at most (a DaemonSet agent's node may have many pods).
WORKERS = 2
#: How long a sidecar's watch of its pod lasts before it is renewed (one request per sidecar
#: per this many seconds in fallback: 10,000 sidecars, about 33 requests/s).
WATCH_TIMEOUT = 300


class FallbackWriter:
    """Sends what the decider hands out (:meth:`submit`), with ``WORKERS`` tasks (:meth:`run`)."""

    def __init__(
        self,
        client: KubeClient,
        core: Fallback,
        *,
        who: str,
        metrics: MetricsSink,
        rng: random.Random | None = None,
        owns_client: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self._clock = clock
        self._owns_client = owns_client
        self._core = core
        self._who = who
        self._metrics = metrics
        self._rng = rng or random.Random()
        #: Pods to write, one worker per pod at a time: a pod's writes go one after the other,
        #: each on the version the previous one's answer showed (no 409 between a label and a
        #: condition); a failing pod waits for its retry without holding a worker.
        self._queue: KeyedQueue[PodKey] = KeyedQueue(rng=self._rng)
        #: Each failing pod's current failure, for the logs (logged when it starts or changes).
        self._trouble: dict[PodKey, str] = {}
        #: Writes handed over (by the decider, or by a failed attempt for its retry) and not
        #: attempted yet: one no longer wanted when its pod's worker is done is dropped.
        self._handed: dict[tuple[PodKey, WriteKind], Write] = {}
        self._event_trouble = ""

    def submit(self, write: Write) -> None:
        """Queue the pod of a write the decider wants (once, however often)."""
        self._handed[write.key, write.kind] = write
        self._queue.add(write.key)

    async def permit(self) -> None:
        """Wait for this agent's next request within its share of the fleet's API budget
        (:mod:`node_agent.fallback.budget`; at once without one)."""
        budget = self._core.budget
        if budget is not None:
            wait = budget.reserve() - self._clock()
            if wait > 0:
                self._metrics.fallback_waited(wait)
                await asyncio.sleep(wait)

    async def run(self) -> None:
        try:
            await self._queue.serve(self._write_pod, workers=WORKERS, name="fallback-writer")
        finally:
            if self._owns_client:
                self.client.close()

    async def follow_pod(
        self, key: PodKey, seen: Callable[[PodFacts], None], gone: Callable[[PodKey], None]
    ) -> None:
        """Until cancelled (a sidecar, while fallback lasts): its pod as listed, then every
        change of it (a manual override added or taken off, a write of someone else), through
        a watch of that one pod (field selector ``metadata.name``): one list and one watch,
        renewed every ``WATCH_TIMEOUT`` seconds. An account that may not list or watch pods
        (a Role that grants ``get`` only, as the sidecar example did before) reads the pod once
        instead, and says so."""
        watch: PodWatch[PodFacts] = PodWatch(
            self.client,
            namespaces=(key.namespace,),
            label_selector="",
            field_selector=f"metadata.name={key.name}",
            parse=PodFacts.from_pod,
            upsert=seen,
            delete=lambda facts: gone(facts.key),
            watch_timeout=WATCH_TIMEOUT,
            fatal=lambda error: isinstance(error, APIForbiddenError),
        )
        await self.permit()  # its list and its watch: one slot
        try:
            await watch.run()
        except APIForbiddenError as error:
            log.error(
                "%s: cannot watch pod %s (%s): reading it once instead, so a change made to it "
                "during this fallback (a manual override) is not seen; grant pods list and watch",
                marks.WHY,
                key,
                error,
            )
            facts = await self.read_pod(key)
            if facts is not None:
                seen(facts)
        finally:
            watch.stop()

    async def follow_lease(self, name: LeaseName, to: LeaseListener) -> None:
        """The aggregator's Lease, while no stream is up
        (:mod:`node_agent.fallback.lease_watch`)."""
        await follow_lease(self.client, name, to, self._rng, self.permit)

    async def read_pod(self, key: PodKey) -> PodFacts | None:
        """The pod as the API shows it now (a sidecar that may not watch it), retried like a
        write while fallback lasts; None if it is gone, cannot be read, or fallback ended."""
        backoff, trouble, attempts = self._backoff(), "", 0
        while self._core.phase is FallbackPhase.FALLBACK:
            await self.permit()
            try:
                return PodFacts.from_pod(await self.client.get_pod(key))
            except APINotFoundError:
                log.warning("%s: pod %s not found; nothing to write", marks.WHY, key)
                return None
            except APIError as error:
                attempts += 1
                if not error.retryable:
                    log.error("%s: cannot read pod %s: %s; not writing", marks.WHY, key, error)
                    return None
                if str(error.status) != trouble:
                    trouble = str(error.status)
                    log.warning(
                        "%s: cannot read pod %s: %s; retrying with backoff (logged again when "
                        "this changes)",
                        marks.WHY,
                        key,
                        error,
                    )
                await asyncio.sleep(retry_delay(error.retry_after, backoff.next))
        return None

    # -- the work -------------------------------------------------------------------------

    def _backoff(self) -> Backoff:
        """Retries: full jitter up to 0.2 s, 0.4 s, ... 30 s; a Retry-After is honoured within
        the same bounds (:func:`servehealth_common.backoff.retry_delay`)."""
        return Backoff(base=RETRY_FLOOR, cap=RETRY_CAP, rng=self._rng)

    async def _write_pod(self, key: PodKey) -> None:
        """What ``key`` should be written now, one target after the other, each asked of the
        decider when its attempt goes, until one must wait (its retry, or another go on a
        newer version of the pod). A target goes once a pass: an answer that does not show a
        write cannot make it loop."""
        sent: set[tuple[WriteKind, str]] = set()
        while (write := self._core.next_write(key)) is not None:
            if (write.kind, write.value) in sent:
                break
            sent.add((write.kind, write.value))
            self._handed.pop((key, write.kind), None)
            try:
                over = await self._attempt(write)
            except Exception:  # a surprise must not stop the other writes
                log.exception("%s: write of %s failed", marks.WHY, write)
                self._core.finished(write, gave_up=True)
                self._metrics.fallback_write(write.kind.value, "error")
                over = True
            if not over:
                return
        for kind in WriteKind:  # what is left was handed over and is no longer wanted
            handed = self._handed.pop((key, kind), None)
            if handed is not None:
                self._dropped(handed)
        self._trouble.pop(key, None)

    async def _attempt(self, write: Write) -> bool:
        """One attempt of ``write``, once its slot comes, as the decider wants it then (on the
        pod's latest version known). True when it is over: landed, the pod gone, failed for
        good, or no longer wanted; False when it goes again (its retry, with the queue's
        backoff)."""
        await self.permit()
        now_wanted = self._core.next_write(write.key)  # (the wait for a slot can be long)
        if now_wanted is None or (now_wanted.kind, now_wanted.value) != (write.kind, write.value):
            self._dropped(write)
            return True
        write, now = now_wanted, utc_now()
        try:
            answer = await self._send(write, now)
        except APINotFoundError:
            self._gone(write)
            return True
        except APIError as error:
            return self._failed(write, error)
        await self._landed(write, answer, self._queue.failures(write.key), now)
        self._queue.forget(write.key)
        return True

    def _failed(self, write: Write, error: APIError) -> bool:
        """A failed attempt of ``write``: over (a conflict, or an error not worth retrying), or
        not (False: the pod's key is queued again, at once or after its backoff)."""
        if error.status == 409 and write.version:
            facts = self._core.facts(write.key)
            if facts is not None and facts.resource_version != write.version:
                self._queue.add(write.key)  # a newer version is known already: try on it
                return False
            self._conflict(write)
            return True
        self._metrics.fallback_write(write.kind.value, "error")
        if not error.retryable and error.status != 409:
            log.error("%s: cannot write %s: %s; not retried", marks.WHY, write, error)
            self._core.finished(write, gave_up=True)
            return True
        self._queue.retry(write.key, error.retry_after)
        self._handed[write.key, write.kind] = write
        self._retrying(write, error)
        return False

    def _retrying(self, write: Write, error: APIError) -> None:
        """Log a failed attempt when the failure starts or changes."""
        condition = f"HTTP {error.status}" if error.status else "no answer"
        trouble = self._trouble.get(write.key, "")
        self._trouble[write.key] = condition
        if condition != trouble:
            was = f" (was: {trouble})" if trouble else ""
            log.warning(
                "%s: cannot write %s: %s%s; retrying with backoff (logged again when this "
                "changes or ends)",
                marks.WHY,
                write,
                error,
                was,
            )
        else:
            attempts = self._queue.failures(write.key)
            log.debug("%s: %s: %s (attempt %d)", marks.WHY, write, error, attempts)

    def _dropped(self, write: Write) -> None:
        """``write`` is not sent: no longer wanted (an aggregator came back, an override came,
        the probes changed their mind)."""
        self._metrics.fallback_write(write.kind.value, "dropped")
        log.debug("%s: %s not sent: no longer wanted", marks.WHY, write)

    def _conflict(self, write: Write) -> None:
        """The pod changed since ``write`` was decided (409 on its resourceVersion): decide
        again from the pod as it is now (a manual override may have come)."""
        self._core.conflicted(write)
        self._metrics.fallback_write(write.kind.value, "conflict")
        log.info(
            "%s: pod %s changed since version %s; %s not sent, deciding again from the pod as "
            "it is now",
            marks.WHY,
            write.key,
            write.version,
            write,
        )

    def _gone(self, write: Write) -> None:
        """The pod of ``write`` is gone (404): forget it and drop the write."""
        self._core.pod_gone(write.key)
        self._core.finished(write)
        self._metrics.fallback_write(write.kind.value, "not_found")
        log.info(
            "%s: pod %s is gone; dropping its %s write", marks.WHY, write.key, write.kind.value
        )

    async def _landed(
        self, write: Write, answer: dict[str, Any], attempts: int, now: datetime.datetime
    ) -> None:
        """``write`` landed: count it, log it, learn what the pod now carries, send its Event."""
        self._metrics.fallback_write(write.kind.value, "success")
        after = f" after {attempts} failed attempts" if attempts else ""
        log.info(
            "%s: wrote %s (%s) as the agent %s%s",
            marks.WHY,
            write,
            write.cause,
            self._who,
            after,
        )
        facts = PodFacts.from_pod(answer) if answer.get("metadata") else None
        self._core.finished(write, answer=facts, written=True)
        if facts is not None and write.version and facts.resource_version == write.version:
            return  # it changed nothing (the pod carried it already): no Event
        await self._event(write, now)

    async def _send(self, write: Write, now: datetime.datetime) -> dict[str, Any]:
        body = write_body(write, self._who, now)
        if write.kind is WriteKind.LABEL:
            return await self.client.patch_pod(write.key, body)
        return await self.client.patch_pod_status(write.key, body)

    async def _event(self, write: Write, now: datetime.datetime) -> None:
        """The write's Event (best effort: one try, in the write's slot if it has room left,
        else in the next, and only if the fallback that wrote it still lasts; failures logged
        when they start or change)."""
        budget = self._core.budget
        if budget is not None and not budget.try_reserve():
            await self.permit()  # no room left in the write's slot: the next one
        if not self._core.in_this_fallback(write):
            return  # an aggregator is back meanwhile: nothing more is sent
        try:
            await self.client.create_event(write.key.namespace, event_body(write, self._who, now))
        except APIError as error:
            self._metrics.fallback_write("event", "error")
            trouble = f"HTTP {error.status}" if error.status else "no answer"
            if trouble != self._event_trouble:
                self._event_trouble = trouble
                log.warning(
                    "%s: event for pod %s not recorded: %s (logged again when this changes)",
                    marks.WHY,
                    write.key,
                    error,
                )
            return
        self._metrics.fallback_write("event", "success")
        if self._event_trouble:
            log.info("%s: events are recorded again", marks.WHY)
            self._event_trouble = ""


async def open_sidecar_writer(
    settings: AgentFlags, core: Fallback, *, who: str, metrics: MetricsSink
) -> FallbackWriter | None:
    """A sidecar's writer, with a Kubernetes client of its own (``--kubeconfig``, else the
    in-cluster ServiceAccount), made when fallback first begins (the configuration is read in
    a thread: never on the event loop); None (logged) without one."""
    try:
        client = await asyncio.to_thread(_sidecar_client, settings)
    except NoKubeConfig as error:
        log.error("%s: cannot write for my pod: %s", marks.WHY, error)
        return None
    return FallbackWriter(client, core, who=who, metrics=metrics, owns_client=True)


def _sidecar_client(settings: AgentFlags) -> KubeClient:
    return make_kube_client(settings)  # the same client as a DaemonSet agent's
