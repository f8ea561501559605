"""The leader's label on its own pod, so that a Service selecting it routes agents to the leader.

Every replica is Ready (a standby too: a PodDisruptionBudget, ``kubectl rollout status`` and
GitOps health checks need it), so readiness can no longer tell the Service which replica leads.
The leader says it with a label instead, as Patroni and other primary/replica systems do:

- at start, each replica removes the label from its own pod (a container restarted in the same
  pod keeps its labels) and is not Ready until it has (:attr:`LeaderLabel.settled`), so a
  stale label never routes agents to a standby;
- once it leads and serves, the leader puts ``<key>: "true"`` on its own pod, then removes the
  label from any other pod of its namespace (an old leader cut off from the API could not);
- when it stops leading (SIGTERM, or the Lease lost), it removes the label from its own pod,
  within a short deadline (it may not reach the API: its readiness already fails, which takes
  it out of the Service anyway, and the next leader cleans up).

Each step retries, with capped jittered backoff, until it succeeds or is cancelled; a streak of
failures is logged when it starts and when it ends. Nothing here imports the Kubernetes client:
the pods are reached through :class:`OwnPods` (``aggregator/leader/own_pods.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from servehealth_common.backoff import Backoff
from servehealth_common.kube.errors import APIError

log = logging.getLogger(__name__)

LEADER = "true"
T = TypeVar("T")


class OwnPods(Protocol):
    """The pods of the aggregator's own namespace. Failures raise
    :mod:`servehealth_common.kube.errors`; each call carries its own deadline."""

    def describe(self, name: str) -> str:
        """``namespace/name``, for logs."""

    async def set_label(self, name: str, key: str, value: str | None) -> None:
        """Set (or, with None, remove) label ``key`` on pod ``name``."""

    async def labelled(self, key: str, value: str) -> list[str]:
        """Names of the pods carrying ``key=value``."""


@dataclass(frozen=True, slots=True)
class LeaderLabelSettings:
    #: The label key (``--leader-label``); its value is always ``"true"``.
    key: str
    #: This replica's pod (``$POD_NAME``).
    pod: str
    #: How long removing the label may take when leadership ends.
    drop_within: float = 1.0
    #: Backoff between failed attempts.
    retry_base: float = 0.2
    retry_cap: float = 5.0


class LeaderLabel:
    """:meth:`start` as a standby (clears a stale label in the background), :meth:`lead` once
    leading and serving (claims the label in the background), ``await`` :meth:`stop` when
    leadership or the process ends (removes the label if it was claimed). :attr:`settled` is
    what readiness waits for."""

    def __init__(
        self,
        pods: OwnPods,
        settings: LeaderLabelSettings,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._pods = pods
        self._settings = settings
        self._sleep = sleep
        self._rng = rng or random.Random()
        #: True once this pod is known not to carry a stale label (readiness waits for it).
        self.settled = False
        #: True once a claim was sent (its answer may have been lost): drop() then removes it.
        self._claimed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """As a standby: remove a stale label from this pod, in the background."""
        self._task = asyncio.create_task(self.clear_own(), name="leader-label-clear")

    def lead(self) -> None:
        """Leading and serving: label this pod (and unlabel others), in the background."""
        self._cancel()
        self._task = asyncio.create_task(self.claim(), name="leader-label-claim")

    async def stop(self) -> None:
        """Stop whatever runs; remove the label from this pod if it was claimed."""
        task = self._cancel()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        await self.drop()

    def _cancel(self) -> asyncio.Task[None] | None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    @property
    def key(self) -> str:
        return self._settings.key

    async def clear_own(self) -> None:
        """Remove the label from this replica's own pod (retried until it succeeds)."""
        own = self._settings.pod
        await self._retry(f"remove label {self.key} from own pod", self._set, own, None)
        self.settled = True
        log.info("leader label: %s carries no %s", self._pods.describe(own), self.key)

    async def claim(self) -> None:
        """Label this replica's pod as the leader, then unlabel every other pod (retried)."""
        self._claimed = True
        own = self._settings.pod
        await self._retry(f"label own pod {self.key}={LEADER}", self._set, own, LEADER)
        self.settled = True
        stale = await self._retry(
            f"list pods labelled {self.key}={LEADER}", self._pods.labelled, self.key, LEADER
        )
        for name in stale:
            if name != own:
                log.warning(
                    "leader label: %s still carries %s=%s (an old leader cut off from the "
                    "API?): removing it",
                    self._pods.describe(name),
                    self.key,
                    LEADER,
                )
                await self._retry(f"remove label {self.key} from {name}", self._set, name, None)
        log.info(
            "leader label: %s=%s on %s; the Service routes agents here",
            self.key,
            LEADER,
            self._pods.describe(own),
        )

    async def drop(self) -> None:
        """Leadership ends: remove the label from this replica's pod, within ``drop_within``
        (best effort: the next leader removes it if this cannot)."""
        if not self._claimed:
            return
        self._claimed = False
        own = self._pods.describe(self._settings.pod)
        try:
            async with asyncio.timeout(self._settings.drop_within):
                await self._retry(
                    f"remove label {self.key} from own pod", self._set, self._settings.pod, None
                )
        except TimeoutError:
            log.warning(
                "leader label: could not remove %s from %s within %gs; its readiness fails, "
                "and the next leader removes it",
                self.key,
                own,
                self._settings.drop_within,
            )
            return
        log.info("leader label: removed %s from %s", self.key, own)

    async def _set(self, pod: str, value: str | None) -> None:
        await self._pods.set_label(pod, self.key, value)

    async def _retry(self, what: str, call: Callable[..., Awaitable[T]], *args: object) -> T:
        """``await call(*args)`` until it succeeds; a streak of API errors is logged once
        when it starts and once when it ends."""
        backoff = Backoff(self._settings.retry_base, self._settings.retry_cap, self._rng)
        failures = 0
        while True:
            try:
                result = await call(*args)
            except APIError as error:
                failures += 1
                if failures == 1:
                    log.warning("leader label: %s failed: %s; retrying", what, error)
                await self._sleep(backoff.next())
                continue
            if failures:
                log.info("leader label: %s succeeded after %d failures", what, failures)
            return result
