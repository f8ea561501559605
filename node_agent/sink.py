"""What the agent tells its metrics, through one small interface.

The probe loops (:mod:`node_agent.probing`, keyed by the agent: :mod:`node_agent.agent`,
:mod:`node_agent.daemonset`), the stream (:mod:`node_agent.stream`) and the fallback writes
(:mod:`node_agent.fallback.runner`, :mod:`node_agent.fallback.writer`) call a
:class:`MetricsSink`; only :mod:`node_agent.metrics`, loaded with ``--metrics-listen``, knows
Prometheus. Without the flag they call :data:`NO_METRICS`, which does nothing (and the agent
never loads prometheus_client). Every call is cheap: a few per probe turn, one per stream
event; each is made from the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from servehealth_common.states import ServeState


class MetricsSink:
    """What the agent tells its metrics; every method does nothing here (:class:`NoMetrics`),
    :class:`~node_agent.metrics.AgentMetrics` overrides them."""

    def probing(self, key: Hashable, namespace: str, name: str) -> None:
        """A probe loop for the pod ``namespace/name`` starts; ``key`` names it from now on."""

    def probed(self, key: Hashable, state: ServeState, seconds: float) -> None:
        """A probe turn of ``key`` ended with ``state``, ``seconds`` after it started (a
        confirmed failure: both probes and the delay between)."""

    def not_probing(self, key: Hashable) -> None:
        """The pod's probe loop stopped (the pod left the agent's view, or the agent stops)."""

    def connected(self, up: bool) -> None:
        """A Report stream was accepted by an aggregator (True), or is no longer open (False)."""

    def stream_failed(self) -> None:
        """A Report stream could not be opened, or ended; the agent tries again."""

    def fallback_clock(self, seconds: Callable[[], float]) -> None:
        """``seconds()`` is how long the agent has been in fallback now (0: it is not)."""

    def fallback_write(self, kind: str, result: str) -> None:
        """A fallback write (``label``, ``condition`` or ``event``) ended with ``result``
        (``success``, ``error``, ``not_found``, ``dropped``, ``conflict``)."""

    def fallback_gauges(
        self, lease_renewed: Callable[[], float], slot_seconds: Callable[[], float]
    ) -> None:
        """At scrape time: whether the aggregators' Lease is seen renewed (1) or not (0: not
        read, not renewed, or none named), and the seconds between two slots of the agent's
        API budget."""

    def fallback_waited(self, seconds: float) -> None:
        """A fallback request waited ``seconds`` for the agent's next slot."""


class NoMetrics(MetricsSink):
    """The sink of an agent without ``--metrics-listen``."""


NO_METRICS: MetricsSink = NoMetrics()
