"""The ray-serve-health node agent: probes a Ray Serve proxy and streams its health."""

__version__ = "0.1.0"
