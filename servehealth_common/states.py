"""The states a pod's Serve proxy can be in, as plain Python enums.

The numbers equal those of ``servehealth.v1.ServeState`` and ``servehealth.v1.Source`` in
``proto/servehealth/v1/servehealth.proto`` (a test keeps them in step), so adapters convert
with ``int()`` and the pure core never imports generated code.
"""

from __future__ import annotations

import enum


class ServeState(enum.IntEnum):
    SERVING = 1
    NOT_READY = 2
    DRAINING = 3
    NO_PROXY = 4
    UNHEALTHY = 5
    SILENT = 6  # aggregator only: no report within the heartbeat TTL
    UNKNOWN = 7  # aggregator only: nothing observed yet
    #: aggregator only: NO_PROXY where the Serve controller runs no proxy by design
    NO_PROXY_BY_DESIGN = 8

    @property
    def serving(self) -> bool:
        return self is ServeState.SERVING


#: States an agent (or a pull probe) may report; SILENT, UNKNOWN and NO_PROXY_BY_DESIGN are
#: the aggregator's own.
OBSERVABLE_STATES: frozenset[ServeState] = frozenset(
    {
        ServeState.SERVING,
        ServeState.NOT_READY,
        ServeState.DRAINING,
        ServeState.NO_PROXY,
        ServeState.UNHEALTHY,
    }
)


class Source(enum.IntEnum):
    PUSH = 1
    PULL = 2
    SEED = 3


def label_value(state: ServeState) -> str:
    """The serve label a pod in ``state`` should carry: ``"true"`` only when SERVING."""
    return "true" if state is ServeState.SERVING else "false"
