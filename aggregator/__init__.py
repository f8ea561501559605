"""The ray-serve-health aggregator: tracks every Ray pod's Serve proxy and decides its label."""

__version__ = "0.2.0"
