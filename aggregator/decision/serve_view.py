"""The Serve controller's view of where proxies run, and what a refused connection means.

With ``proxy_location: HeadOnly`` (or ``Disabled``) Ray Serve runs no proxy on worker nodes,
ever; with the default ``EveryNode`` it runs one only on the head and on nodes that host a
replica (Ray 2.60, ``ProxyStateManager._get_target_nodes``). Such a pod refuses every probe, so
its agent reports NO_PROXY, which alone cannot be told from a proxy that died. The controller
can tell: the head's dashboard answers ``GET /api/serve/applications/`` with
``proxy_location`` and ``proxies`` (by node id: ``node_ip``, ``status``).

This module is pure: :func:`parse_view` turns that answer into a :class:`ServeView`,
:func:`proxy_meant` answers "is a proxy meant to run at this pod IP?" (yes, no or unknown, with
the evidence), and :func:`judge_no_proxy` decides what a NO_PROXY observation becomes. The
polling is :mod:`aggregator.pull.serve_view_poller`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from aggregator.decision.tracker import Observation, PodRecord
from servehealth_common.states import ServeState

#: Proxy statuses of a proxy Serve keeps (``DRAINING``/``DRAINED``: Serve is removing it).
LIVE_PROXY_STATUSES = frozenset({"STARTING", "HEALTHY", "UNHEALTHY"})
LOCATIONS = frozenset({"EveryNode", "HeadOnly", "Disabled"})
#: The states a refused connection leads to.
NO_PROXY_STATES = frozenset({ServeState.NO_PROXY, ServeState.NO_PROXY_BY_DESIGN})


class BadView(ValueError):
    """The dashboard's answer is not the Serve instance details it should be."""


@dataclass(frozen=True, slots=True)
class ServeView:
    """What one Ray cluster's Serve controller says about its proxies.

    ``proxy_location`` is None when no Serve instance runs (the dashboard then answers an
    empty schema): nothing can be concluded from such a view.
    """

    proxy_location: str | None
    #: node IP -> proxy status, for each proxy the controller keeps.
    proxies: tuple[tuple[str, str], ...] = ()

    def status_at(self, ip: str) -> str | None:
        return dict(self.proxies).get(ip)


@dataclass(frozen=True, slots=True)
class ProxyIntent:
    """Whether a proxy is meant to run at a pod: True, False, or None (unknown)."""

    meant: bool | None
    reason: str = ""


UNKNOWN = ProxyIntent(None, "")


def parse_view(document: Any) -> ServeView:
    """The :class:`ServeView` of a decoded ``/api/serve/applications/`` answer; BadView if it
    is not one."""
    if not isinstance(document, dict):
        raise BadView(f"not a JSON object but {type(document).__name__}")
    location = document.get("proxy_location")
    if location is not None and location not in LOCATIONS:
        raise BadView(f"unknown proxy_location {location!r}")
    proxies = {} if document.get("proxies") is None else document["proxies"]
    if not isinstance(proxies, dict):
        raise BadView("proxies is not an object")
    found: dict[str, str] = {}
    for node_id, proxy in proxies.items():
        if not isinstance(proxy, dict):
            raise BadView(f"proxy of node {node_id!r} is not an object")
        node_ip, status = proxy.get("node_ip"), proxy.get("status")
        if not isinstance(node_ip, str) or not isinstance(status, str):
            raise BadView(f"proxy of node {node_id!r} has no node_ip or status")
        found[node_ip] = status
    return ServeView(location, tuple(sorted(found.items())))


def proxy_meant(view: ServeView | None, pod_ip: str, *, head: bool) -> ProxyIntent:
    """Is a Serve proxy meant to run at ``pod_ip`` (a KubeRay pod is a Ray node: its IP is
    the node's)? ``head``: the pod is its cluster's head. No view, no address, or no Serve
    instance: unknown."""
    if view is None or view.proxy_location is None or not pod_ip:
        return UNKNOWN
    location = view.proxy_location
    status = view.status_at(pod_ip)
    if location == "Disabled":
        return ProxyIntent(False, "proxy_location Disabled: Serve runs no proxy on any node")
    if status in LIVE_PROXY_STATUSES:
        return ProxyIntent(True, f"Serve keeps a proxy on node {pod_ip} ({status})")
    if location == "HeadOnly":
        if head:
            return ProxyIntent(True, "proxy_location HeadOnly: Serve runs the proxy on the head")
        return ProxyIntent(False, "proxy_location HeadOnly: Serve runs no proxy on worker nodes")
    if head:  # EveryNode: the controller's node always has one (it runs on the head)
        return ProxyIntent(True, "proxy_location EveryNode: Serve runs a proxy on the head")
    if status is not None:
        return ProxyIntent(False, f"Serve is removing the proxy on node {pod_ip} ({status})")
    return ProxyIntent(False, f"Serve runs no proxy on node {pod_ip} (no replica there)")


def judge_no_proxy(
    observed: ServeState,
    reason: str,
    current: ServeState,
    current_reason: str,
    verdict: ProxyIntent,
) -> tuple[ServeState, str]:
    """What an observation of ``observed`` (with ``reason``) means for a pod now in ``current``
    (for ``current_reason``).

    Only NO_PROXY is judged: where no proxy is meant to run it is NO_PROXY_BY_DESIGN, its
    reason the evidence. An unknown verdict (the dashboard never answered, or failed since the
    pod was judged) keeps a pod already NO_PROXY_BY_DESIGN there: a dashboard hiccup never
    makes it flap. Every other observation is what it is.
    """
    if observed is not ServeState.NO_PROXY:
        return observed, reason
    if verdict.meant is False:
        evidence = f"{verdict.reason} (probe: {reason})" if reason else verdict.reason
        return ServeState.NO_PROXY_BY_DESIGN, evidence
    if verdict.meant is None and current is ServeState.NO_PROXY_BY_DESIGN:
        return ServeState.NO_PROXY_BY_DESIGN, current_reason
    return observed, reason


def judged(observation: Observation, record: PodRecord, verdict: ProxyIntent) -> Observation:
    """``observation`` of the pod of ``record``, judged (:func:`judge_no_proxy`)."""
    state, reason = judge_no_proxy(
        observation.state, observation.reason, record.state, record.reason, verdict
    )
    if state is observation.state:
        return observation
    return replace(observation, state=state, reason=reason)


def rejudged(record: PodRecord, verdict: ProxyIntent) -> tuple[ServeState, str] | None:
    """The state and reason of a pod in NO_PROXY or NO_PROXY_BY_DESIGN once the view of its
    cluster changed, or None to leave it. Only a pod whose last observation was that refused
    connection is judged again: not one only seeded (never observed), nor one whose last
    observation disagreed with its state (a streak towards SERVING)."""
    if record.state not in NO_PROXY_STATES or record.streak or record.observed_at is None:
        return None
    probe = record.reason if record.state is ServeState.NO_PROXY else ""
    state, reason = judge_no_proxy(ServeState.NO_PROXY, probe, record.state, record.reason, verdict)
    if state is record.state:
        return None
    if state is ServeState.NO_PROXY:
        reason = f"{verdict.reason}, and the pod's last probe was refused"
    return state, reason
