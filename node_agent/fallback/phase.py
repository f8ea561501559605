"""The phases of an agent's fallback, and the moves between them (see
:meth:`node_agent.fallback.decider.Fallback._move` for the diagram)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FallbackPhase(enum.Enum):
    CONNECTED = "connected"
    WAITING = "waiting"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class FallbackChange:
    old: FallbackPhase
    new: FallbackPhase
    #: Seconds without an accepted stream (began), or in fallback (ended).
    seconds: float


#: The moves allowed between phases.
ALLOWED = frozenset(
    {
        (FallbackPhase.WAITING, FallbackPhase.CONNECTED),
        (FallbackPhase.CONNECTED, FallbackPhase.WAITING),
        (FallbackPhase.WAITING, FallbackPhase.FALLBACK),
        (FallbackPhase.FALLBACK, FallbackPhase.CONNECTED),
        (FallbackPhase.FALLBACK, FallbackPhase.WAITING),
    }
)
