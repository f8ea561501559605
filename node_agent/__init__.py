"""The ray-serve-health node agent: probes a Ray Serve proxy and streams its health."""

from servehealth_common.version import __version__

__all__ = ["__version__"]
