"""The ray-serve-health aggregator: tracks every Ray pod's Serve proxy and decides its label."""

from servehealth_common.version import __version__

__all__ = ["__version__"]
