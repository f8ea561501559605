"""The agent's read of the aggregator's Lease while it has no stream (issue 26): a ``get`` of
that one Lease, then a ``watch`` of it from the resourceVersion read (field selector
``metadata.name``), both again when the watch ends (every ``WATCH_TIMEOUT`` seconds,
jittered). An agent needs ``get`` and ``watch`` on that one Lease only (RBAC ``resourceNames``): no
``list``.

Read only by an agent that has something to write (:meth:`~node_agent.fallback.decider.Fallback.
lease_wanted`), never while its stream is up; each request waits for the agent's share of the
fleet's API budget (``permit``: :mod:`node_agent.fallback.budget`), so the ``get`` and the first
``watch`` of a fleet that lost its aggregator are spread over the budget's period. Errors are
retried with capped, jittered backoff (1 s up to 60 s); each tells the listener the Lease is
unreadable (which opens the gate only if it was never read: :mod:`node_agent.fallback.lease_gate`).

The official client is synchronous: the watch runs in a daemon thread and hands events to the
loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from node_agent.fallback.lease_gate import LeaseName, LeaseSeen
from node_agent.fallback.ports import LeaseListener
from servehealth_common.backoff import Backoff, jittered
from servehealth_common.kube.client import KubeClient
from servehealth_common.kube.errors import APIError, APIGoneError, APINotFoundError
from servehealth_common.kube.watch import events_from_thread

log = logging.getLogger(__name__)

#: The watch's server timeout, jittered by 10 % (as kube-apiserver's --min-request-timeout):
#: a read and a watch per agent per ~30 minutes while it needs the Lease.
WATCH_TIMEOUT = 1800
RETRY_BASE, RETRY_CAP = 1.0, 60.0


async def follow_lease(
    kube: KubeClient,
    name: LeaseName,
    to: LeaseListener,
    rng: random.Random,
    permit: Callable[[], Awaitable[None]],
) -> None:
    """Until cancelled: what the Lease shows, to ``to``: a read, then a watch from its version,
    back to back (both within the agent's budget: ``permit``), again when the watch ends.
    Between two watches (waiting for a slot) the Lease is not observed (``to.lease_gap``):
    nothing decided then may count on it."""
    backoff, trouble = Backoff(base=RETRY_BASE, cap=RETRY_CAP, rng=rng), ""
    while True:
        to.lease_gap(name)
        try:
            await permit()  # the read ...
            await permit()  # ... and its watch, in one go
            version = await _get(kube, name, to)
            if trouble:
                log.info("Lease %s is readable again", name)
                trouble = ""
            backoff.reset()
            seconds = round(jittered(WATCH_TIMEOUT, rng))
            await _watch(kube, name, version, to, seconds)
        except APIGoneError:
            pass  # the watch's version is too old: read it again
        except APIError as error:
            if str(error) != trouble:
                trouble = str(error)
                log.warning("cannot read Lease %s (%s): retrying", name, error)
            to.lease_unreadable(name)
            await asyncio.sleep(backoff.next())


async def _get(kube: KubeClient, name: LeaseName, to: LeaseListener) -> str:
    """The Lease now (to ``to``) and its resourceVersion ("" if it does not exist)."""
    try:
        body = await kube.get_lease(name.namespace, name.name)
    except APINotFoundError:
        to.lease_seen(name, None)
        return ""
    to.lease_seen(name, LeaseSeen.from_lease(body))
    return str((body.get("metadata") or {}).get("resourceVersion", ""))


async def _watch(
    kube: KubeClient, name: LeaseName, version: str, to: LeaseListener, seconds: int
) -> str:
    """One watch, until the server ends it (after ``seconds``) or it fails; read by a daemon
    thread (it never holds up the agent's exit), its events handed to this loop. Returns the
    last resourceVersion seen (to resume from)."""
    stopping = threading.Event()
    events = functools.partial(kube.watch_lease, name.namespace, name.name, version, seconds)
    try:
        async for item in events_from_thread(events, stopping, "watch-lease"):
            _tell(name, item, to)
            metadata = (item.get("object") or {}).get("metadata") or {}
            version = str(metadata.get("resourceVersion") or version)
    finally:
        stopping.set()
    return version


def _tell(name: LeaseName, event: dict[str, Any], to: LeaseListener) -> None:
    kind = event.get("type")
    if kind in ("ADDED", "MODIFIED"):
        to.lease_seen(name, LeaseSeen.from_lease(event.get("object") or {}))
    elif kind == "DELETED":
        to.lease_seen(name, None)
    elif kind == "ERROR":
        status = event.get("object") or {}
        if status.get("code") == 410:
            raise APIGoneError(f"watch lease {name}: its resourceVersion is too old", 410)
        raise APIError(f"watch lease {name}: {status.get('message', status)}")
