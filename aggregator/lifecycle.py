"""The aggregator's phases, and the one gate through which they change.

::

    STARTING ──(no leader election: pods listed)──────────────> LEADING
       │                                                          │  │
       └──(leader election: port open, Lease not held)──> STANDBY │  │
                                                            │  │   │  │
                          Lease held, pods listed, serving ─┘  │   │  │
                          (STANDBY ─> LEADING)                 │   │  │
                                                               v   v  │
                     Lease lost, or election failed ──> STEPPING_DOWN │
                                                               │      │
        any phase but STOPPING/STOPPED ── SIGTERM, or after ───┴──────┴──> STOPPING ──> STOPPED
        stepping down

The gRPC port opens in STARTING (without leader election: it lasts while the first pod list
is retried, the Kubernetes API not answering yet) or in STANDBY (until the Lease is held and
the pods are listed). Only LEADING accepts reports and writes to the API; STEPPING_DOWN stops
every write, then the process stops and exits 1 (its Deployment restarts it as a standby).
Modelled on Ray Serve's ``proxy_state.py``: one method changes the phase, logs the change and
refuses the impossible.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"
    STANDBY = "standby"
    LEADING = "leading"
    STEPPING_DOWN = "stepping down"
    STOPPING = "stopping"
    STOPPED = "stopped"


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.STANDBY, Phase.LEADING, Phase.STOPPING}),
    Phase.STANDBY: frozenset({Phase.LEADING, Phase.STEPPING_DOWN, Phase.STOPPING}),
    Phase.LEADING: frozenset({Phase.STEPPING_DOWN, Phase.STOPPING}),
    Phase.STEPPING_DOWN: frozenset({Phase.STOPPING}),
    Phase.STOPPING: frozenset({Phase.STOPPED}),
    Phase.STOPPED: frozenset(),
}


class ImpossiblePhaseChange(RuntimeError):
    """A change the diagram does not allow: a bug, never something a user can cause."""


class Lifecycle:
    """The current phase; :meth:`move_to` is the only way to change it."""

    def __init__(self, on_change: Callable[[Phase, Phase], None] | None = None) -> None:
        self._phase = Phase.STARTING
        self._on_change = on_change
        #: Why the replica stepped down (None unless it did): the process exits 1.
        self.step_down_reason: str | None = None

    @property
    def phase(self) -> Phase:
        return self._phase

    def move_to(self, phase: Phase, why: str) -> None:
        """Change to ``phase`` (logged with ``why``); ImpossiblePhaseChange if not allowed."""
        old = self._phase
        if phase not in ALLOWED[old]:
            raise ImpossiblePhaseChange(f"{old.value} -> {phase.value} ({why})")
        self._phase = phase
        if phase is Phase.STEPPING_DOWN:
            self.step_down_reason = why
        log.info("aggregator phase: %s -> %s: %s", old.value, phase.value, why)
        if self._on_change is not None:
            self._on_change(old, phase)

    def stopping(self) -> bool:
        """Whether a stop began (a second stop does nothing)."""
        return self._phase in (Phase.STOPPING, Phase.STOPPED)


def not_ready(phase: Phase, label_settled: bool = True) -> str | None:
    """Why this replica is not Ready (``/readyz`` answers 503 with it), or None when it is.

    Ready: the leader once it serves, and a standby once its own pod carries no stale leader
    label (``label_settled``). The Service routes agents by the leader label, not by
    readiness, so a Ready standby gets none; readiness says the replica is healthy, for a
    PodDisruptionBudget and ``kubectl rollout status``. Not Ready while starting (without
    leader election: the first pod list), stepping down and stopping."""
    if phase is Phase.LEADING or (phase is Phase.STANDBY and label_settled):
        return None
    if phase is Phase.STANDBY:
        return "standby: removing a stale leader label from its own pod"
    if phase is Phase.STARTING:
        return "starting: listing the pods"
    return phase.value
