"""Who hears of a Report stream's ups and downs and of what the aggregator sends besides acks
(the agent's fallback, :mod:`node_agent.fallback.runner`)."""

from __future__ import annotations

from servehealth.v1 import servehealth_pb2 as pb


class StreamListener:
    """Told when a stream is accepted and ends, and what each ``AgentSettings`` says of the
    aggregator's writes (the agent's fallback, :mod:`node_agent.fallback.runner`, overrides
    these; here each does nothing: a stream without a fallback)."""

    def settings(self, writes: pb.WriteSettings | None) -> None:
        """An ``AgentSettings`` arrived; ``writes`` None: it had none (before 0.3.0)."""

    def fleet(self, size: int) -> None:
        """``AgentSettings.fleet_size`` (0: the aggregator did not say)."""

    def pod_view(self, view: pb.PodView) -> None:
        """What the aggregator last saw of a sidecar's own pod (``AggregatorMessage.pod``)."""

    def accepted(self) -> None:
        """The aggregator accepted the stream (its first settings arrived)."""

    def ended(self) -> None:
        """An accepted stream is over."""
