"""The ray-serve-health node agent: probes a Ray Serve proxy and streams its health."""

__version__ = "0.2.0"
