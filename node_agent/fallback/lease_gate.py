"""Whether an aggregator is alive, as an agent without a stream sees it (issue 26): pure, with
an injected monotonic clock.

An agent that no aggregator accepts falls back only when no aggregator renews the leader
election's Lease. The Lease is judged as a standby judges it: it is renewed while its record
(holder, ``renewTime``, ``leaseDurationSeconds``) has changed within ``leaseDurationSeconds``
*as seen on this agent's monotonic clock*; the Lease's timestamps are never compared with the
agent's wall clock. A Lease first seen counts as renewed for its duration (a standby waits as
long before it takes over).

No Lease named (no ``--fallback-lease``, an aggregator without ``--leader-elect``): there is
no gate, today's behaviour. A Lease that does not exist, or has no holder (released), is not
renewed. A Lease the agent cannot read before it has seen it once (403: no RBAC for it; an API
that does not answer) leaves the gate open, as before this gate: the agent writes through the
same API, and a missing grant must not stop the fallback. Once seen, the Lease is judged only
while it is being observed (a read just made, a watch open): between two watches (the agent
waits for its slot of the API budget) and after a failed read, nothing the agent decides may
count on it (:meth:`LeaseGate.may_judge`): a renewal made in that gap is seen when the watch
resumes, and writes made in it would be a second writer's (issue 26, bench.fallback_storm).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class LeaseName:
    namespace: str
    name: str

    @classmethod
    def parse(cls, text: str) -> LeaseName | None:
        """``namespace/name``; ``""``: None. Raises ValueError on anything else."""
        if not text:
            return None
        namespace, slash, name = text.partition("/")
        if not slash or not namespace or not name or "/" in name:
            raise ValueError(f"{text[:100]!r} is not namespace/name")
        return cls(namespace, name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class LeaseSeen:
    """What counts in a Lease: a change of any of these is a renewal."""

    holder: str
    renew_time: str
    duration: float

    @classmethod
    def from_lease(cls, lease: Mapping[str, Any]) -> LeaseSeen:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            renew_time=str(spec.get("renewTime") or ""),
            duration=float(spec.get("leaseDurationSeconds") or 0),
        )


class Judged(enum.Enum):
    UNREAD = "not read yet"
    OPEN = "unreadable: the gate is open"
    SEEN = "seen"


class LeaseGate:
    """One agent's view of one Lease: :meth:`seen`, :meth:`absent`, :meth:`unreadable` in;
    :meth:`renewed_until` out."""

    def __init__(self, name: LeaseName, clock: Clock) -> None:
        self.name = name
        self._clock = clock
        self.judged = Judged.UNREAD
        self._record: LeaseSeen | None = None
        self._changed_at = float("-inf")
        self._observing = False  # a read just made, or a watch open

    def forget(self) -> None:
        """A stream was accepted: the next read starts afresh."""
        self.judged, self._record, self._changed_at = Judged.UNREAD, None, float("-inf")
        self._observing = False

    def gap(self) -> None:
        """The watch ended (or a read failed): the Lease is not observed until the next read."""
        self._observing = False

    def may_judge(self) -> bool:
        """Whether decisions may count on the gate now: not read yet or unreadable from the
        start (as before the gate), or seen and observed right now."""
        return self.judged is not Judged.SEEN or self._observing

    def seen(self, record: LeaseSeen) -> bool:
        """The Lease as read; True if it changed (a renewal, or the first read)."""
        self.judged, self._observing = Judged.SEEN, True
        if record == self._record:
            return False
        self._record, self._changed_at = record, self._clock()
        return True

    def absent(self) -> None:
        """The Lease does not exist (404, or deleted): no aggregator leads."""
        self.judged, self._record, self._changed_at = Judged.SEEN, None, float("-inf")
        self._observing = True

    def unreadable(self) -> None:
        """A read failed. Before the Lease was ever seen, the gate opens (today's behaviour);
        afterwards, what was seen ages out by itself."""
        self._observing = False
        if self.judged is Judged.UNREAD:
            self.judged = Judged.OPEN

    def renewed_until(self) -> float | None:
        """Until when (clock time) the Lease counts as renewed; None if not read yet,
        ``-inf`` if it does not (no Lease, no holder, or unreadable)."""
        if self.judged is Judged.UNREAD:
            return None
        record = self._record
        if record is None or not record.holder:
            return float("-inf")
        return self._changed_at + record.duration

    def renewed(self) -> bool:
        until = self.renewed_until()
        return until is not None and until > self._clock()

    def describe(self) -> str:
        record = self._record
        holder = record.holder if record is not None else ""
        return f"Lease {self.name} ({self.judged.value}{', held by ' + holder if holder else ''})"
