"""The latest result of every pod an agent speaks for, and what to send next."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.probe import ProbeResult


class Outbox:
    """The latest result of every pod the agent speaks for, and which of them are due: changed
    since they were last sent, or still owed confirmations. :attr:`changed` is set when one is.

    After a pod's state changes to SERVING, its next ``reports_per_change - 1`` results are due
    as well (``reports_per_failure - 1`` after a change away from SERVING): the aggregator moves
    a pod only after that many observations in a row, and an agent that reports on change would
    otherwise not send the second one until its next resync. Only a pod's latest result is kept:
    one that arrives while the previous one is still unsent replaces it, and is still that one
    report (a confirmation is spent only on a result the stream takes after the one before).

    ``pod`` is the PodRef a report names (None: the sidecar's own pod, left unset).
    """

    def __init__(self) -> None:
        self.changed = asyncio.Event()
        #: Reports in a row after a change to SERVING, and away from it (the aggregator's
        #: AgentSettings.reports_per_change and reports_per_failure).
        self.reports_per_change = 1
        self.reports_per_failure = 1
        self._latest: dict[Hashable, tuple[pb.PodRef | None, ProbeResult]] = {}
        self._dirty: dict[Hashable, None] = {}  # an ordered set
        self._owed: dict[Hashable, int] = {}  # confirmations still to send, by pod

    def put(self, key: Hashable, pod: pb.PodRef | None, result: ProbeResult, changed: bool) -> None:
        """A fresh result; ``changed`` (or a pod new here) sends it at once, and so are the
        confirmations that follow a change."""
        new = key not in self._latest
        self._latest[key] = (pod, result)
        if changed or new:
            reports = self.reports_per_change if result.state.serving else self.reports_per_failure
            self._owed[key] = reports - 1
        elif key in self._dirty:
            return  # replaces a result not sent yet: still one report, no confirmation spent
        elif self._owed.get(key, 0) > 0:
            self._owed[key] -= 1
        else:
            return
        self._dirty[key] = None
        self.changed.set()

    def discard(self, key: Hashable) -> None:
        """Stop reporting ``key`` (the pod is gone, or no longer probed)."""
        self._latest.pop(key, None)
        self._dirty.pop(key, None)
        self._owed.pop(key, None)

    def resend_all(self) -> None:
        """Every pod is due (a new stream tells the aggregator everything at once)."""
        self._dirty = dict.fromkeys(self._latest)
        if self._dirty:
            self.changed.set()

    def take(self, everything: bool) -> list[tuple[pb.PodRef | None, ProbeResult]]:
        """What to send now: every pod (a heartbeat or a resync) or those due."""
        keys = list(self._latest) if everything else list(self._dirty)
        self._dirty.clear()
        return [self._latest[key] for key in keys]

    def __len__(self) -> int:
        return len(self._latest)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._latest
