"""Per-pod health state: the pure core of the aggregator.

No I/O, no gRPC, no Kubernetes: observations come in with the time they were made (from an
injected monotonic clock), transitions come out. Everything that talks to the outside world
(servicers, registry backends, metrics) sits around this module and acts on the transitions.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.streak import Run, Thresholds, side, step
from servehealth_common.states import ServeState, Source, label_value

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Observation:
    """One look at a pod's proxy, by its agent (push) or by the aggregator (pull)."""

    state: ServeState
    reason: str = ""
    http_status: int = 0
    latency: float = 0.0
    source: Source = Source.PUSH


@dataclass(frozen=True, slots=True)
class StateChange:
    key: PodKey
    old: ServeState
    new: ServeState
    source: Source | None
    reason: str
    at: float  # monotonic

    @property
    def label_changed(self) -> bool:
        return label_value(self.old) != label_value(self.new)


@dataclass(slots=True)
class TrackerSettings:
    #: Silence allowed to a pod that no open stream keeps alive: since the last report of an
    #: agent that sends heartbeats, since the stream ended of one that reports on change.
    heartbeat_ttl: float = 3.0
    failure_threshold: int = 1
    success_threshold: int = 2
    #: How long a pull observation stays fresh (pods no agent speaks for are pulled every
    #: pull interval); None: the heartbeat TTL.
    pull_ttl: float | None = None
    #: Silence allowed to a pod whose agent reports on change while its stream is open (a
    #: backstop: such an agent resyncs every pod, and ends its stream if its probes stall).
    #: The core raises it as the resync interval stretches (:meth:`Tracker.allow_silence`).
    kept_ttl: float = 90.0


@dataclass(slots=True)
class PodRecord:
    key: PodKey
    uid: str
    node_name: str
    state: ServeState
    state_since: float
    touched_at: float  # last observation, or registration when nothing was observed yet
    observed_at: float | None = None
    pushed_at: float | None = None  # last observation by an agent (push)
    source: Source | None = None
    reason: str = ""
    http_status: int = 0
    latency: float = 0.0
    streak: int = 0  # consecutive observations on the other side of "serving" than `state`
    agent: int | None = None  # the stream that reports for this pod, if one does
    #: Whether that stream keeps the pod alive (its agent reports on change: its connection,
    #: not its reports, says it is alive).
    kept: bool = False
    agent_left_at: float | None = None  # when such a stream ended, if nothing observed it since

    @property
    def desired_label(self) -> str:
        return label_value(self.state)


class Tracker:
    """One record per pod; the only place where a pod's state changes."""

    def __init__(self, settings: TrackerSettings, clock: Clock) -> None:
        self.settings = settings
        self._clock = clock
        self._records: dict[PodKey, PodRecord] = {}
        # Pods that can still fall silent, least recently touched first: one queue for pods
        # an open on-change stream keeps alive, one for pods last heard from by push (or
        # never, or whose on-change stream ended), one for pods last pulled, each with its own
        # TTL. Observations arrive in clock order, so moving a key to the end of its queue keeps
        # the order and expiry stops at the first fresh pod: its cost is the number of pods
        # that expire, not the fleet size.
        self._kept: OrderedDict[PodKey, None] = OrderedDict()
        self._pushed: OrderedDict[PodKey, None] = OrderedDict()
        self._pulled: OrderedDict[PodKey, None] = OrderedDict()
        self._counts: Counter[ServeState] = Counter()
        self._hold_until = float("-inf")

    # -- membership ---------------------------------------------------------------------

    def register(self, key: PodKey, uid: str = "", node_name: str = "") -> PodRecord:
        """Track ``key`` (UNKNOWN until observed); updates uid/node of a known pod."""
        record = self._records.get(key)
        if record is not None:
            if uid and record.uid != uid:  # same name, new pod: start over
                self.forget(key)
            else:
                record.node_name = node_name or record.node_name
                return record
        now = self._clock()
        record = PodRecord(key, uid, node_name, ServeState.UNKNOWN, now, now)
        self._records[key] = record
        self._pushed[key] = None
        self._counts[ServeState.UNKNOWN] += 1
        return record

    def seed(
        self,
        key: PodKey,
        state: ServeState,
        reason: str = "Taken from the label the pod carried at start.",
    ) -> None:
        """Start a just-registered pod in ``state`` (believed, not observed), with no
        transition: what the cluster already shows when the aggregator starts."""
        record = self._records[key]
        self._counts[record.state] -= 1
        self._counts[state] += 1
        record.state = state
        record.source = Source.SEED
        record.reason = reason

    def hold_expiry(self, seconds: float) -> None:
        """No pod goes SILENT for ``seconds`` from now (agents reconnecting after a start)."""
        self._hold_until = self._clock() + seconds

    def in_grace(self) -> bool:
        """Whether the startup grace (see :meth:`hold_expiry`) is still running."""
        return self._clock() < self._hold_until

    def agent_speaks(self, record: PodRecord, now: float) -> bool:
        """Whether an agent speaks for ``record``: its on-change stream is open, or it is
        connected and has sent a heartbeat within the TTL."""
        if record.agent is None:
            return False
        if record.kept:
            return True
        return record.pushed_at is not None and now - record.pushed_at < self.settings.heartbeat_ttl

    def allow_silence(self, kept_ttl: float) -> None:
        """Raise the TTL of pods kept alive by an open stream (never lowered: streams opened
        earlier resync at the interval they were given)."""
        self.settings.kept_ttl = max(self.settings.kept_ttl, kept_ttl)

    def forget(self, key: PodKey) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            for queue in (self._kept, self._pushed, self._pulled):
                queue.pop(key, None)
            self._counts[record.state] -= 1

    def detach(self, keys: Iterable[PodKey], agent: int) -> None:
        """The stream ``agent`` closed: its pods have no agent (unless another took them over).
        A pod it kept alive gets the heartbeat TTL from now: time for its agent to reconnect,
        or for a pull to see it."""
        now = self._clock()
        for key in keys:
            record = self._records.get(key)
            if record is None or record.agent != agent:
                continue
            record.agent = None
            if record.kept:
                record.kept = False
                record.touched_at = record.agent_left_at = now
                self._kept.pop(key, None)
                self._pushed[key] = None

    # -- observations -------------------------------------------------------------------

    def observe(
        self,
        key: PodKey,
        observation: Observation,
        agent: int | None = None,
        *,
        kept: bool = False,
    ) -> StateChange | None:
        """Record an observation of a registered pod; returns the transition it caused, if any.

        ``agent``: the stream that pushed it, which now speaks for the pod; ``kept``: that
        stream's agent reports on change (its open stream keeps the pod alive).
        """
        record = self._records[key]
        if agent is not None:
            record.agent = agent
            record.kept = kept
        now = self._clock()
        record.touched_at = record.observed_at = now
        record.agent_left_at = None
        if observation.source is Source.PUSH:
            record.pushed_at = now
        record.source = observation.source
        record.reason = observation.reason
        record.http_status = observation.http_status
        record.latency = observation.latency
        if record.kept and record.agent is not None:
            queue = self._kept
        elif observation.source is Source.PULL:
            queue = self._pulled
        else:
            queue = self._pushed
        if key in queue:
            queue.move_to_end(key)
        else:
            for other in (self._kept, self._pushed, self._pulled):
                other.pop(key, None)  # ``queue`` has no ``key``
            queue[key] = None
        return self._gate(record, observation.state, now, observation.source)

    def reclassify(self, key: PodKey, state: ServeState, reason: str) -> StateChange | None:
        """The same observation, judged anew (NO_PROXY <-> NO_PROXY_BY_DESIGN when the Serve
        controller's view changed): ``state`` must be on the same side as the pod's state, and
        nothing was observed, so no time of the record moves."""
        record = self._records[key]
        assert state.serving == record.state.serving, (record.state, state)
        record.reason = reason
        return self._gate(record, state, self._clock(), record.source)

    def expire(self) -> list[StateChange]:
        """Pods not observed for longer than their TTL become SILENT: the kept TTL while an
        on-change stream is open, the heartbeat TTL after a heartbeat (or since registration,
        or since an on-change stream ended), the pull TTL after a pull."""
        now = self._clock()
        if now < self._hold_until:
            return []
        settings = self.settings
        transitions = self._expire(self._kept, now, settings.kept_ttl, "report or resync")
        transitions += self._expire(self._pushed, now, settings.heartbeat_ttl, "report")
        pull_ttl = settings.heartbeat_ttl if settings.pull_ttl is None else settings.pull_ttl
        transitions += self._expire(self._pulled, now, pull_ttl, "successful pull")
        return transitions

    def _expire(
        self, queue: OrderedDict[PodKey, None], now: float, ttl: float, what: str
    ) -> list[StateChange]:
        deadline = now - ttl
        if self._hold_until > deadline:
            # The end of the startup grace counts as the last time every pod was heard from:
            # each gets one TTL after it (pods no agent speaks for get their first pull).
            return []
        transitions: list[StateChange] = []
        records = self._records
        while queue:
            key = next(iter(queue))
            record = records[key]
            if record.touched_at > deadline:
                break
            del queue[key]
            if record.agent_left_at is not None:
                record.reason = (
                    f"Its agent's stream ended {now - record.agent_left_at:.1f}s ago; "
                    f"nothing observed it since (TTL {ttl:g}s)."
                )
            else:
                record.reason = f"No {what} for {now - record.touched_at:.1f}s (TTL {ttl:g}s)."
            transition = self._gate(record, ServeState.SILENT, now, None)
            if transition is not None:
                transitions.append(transition)
        return transitions

    def _gate(
        self, record: PodRecord, observed: ServeState, now: float, source: Source | None
    ) -> StateChange | None:
        """The one transition function.

        ::

                        first observation (any state)
            UNKNOWN ----------------------------------------> observed state
                          failure_threshold consecutive
                          non-SERVING observations
            SERVING  ---------------------------------------> NOT_READY | DRAINING |
               ^                                              NO_PROXY | UNHEALTHY |
               |                                              NO_PROXY_BY_DESIGN
               |         success_threshold consecutive          |  (moves between these
               +------- SERVING observations (hysteresis) ------+   at once: the label
                                                                     does not change)
            any state ---- no observation for heartbeat_ttl ---> SILENT  (at once)
            SILENT   ---- next observation, as from UNKNOWN ---> observed state

        Only a change of side (serving or not) is held back by a threshold; an observation on
        the same side as the current state resets the streak. The count is the step both
        programs take (:func:`servehealth_common.pod_writes.streak.step`): here UNHEALTHY
        counts out of service and a first observation is taken at once, where an agent in
        fallback does neither (that module says why). NO_PROXY_BY_DESIGN arrives here already
        judged: the core turns NO_PROXY into it where the Serve controller runs no proxy
        (:func:`aggregator.decision.serve_view.judge_no_proxy`).
        """
        current = record.state
        if observed is current:
            record.streak = 0
            return None
        # SILENT comes at once (the TTL already was the patience); a move within a side too.
        if observed is not ServeState.SILENT and observed.serving != current.serving:
            # The run: the observations in a row on the other side than ``current`` (one on
            # its side, or a transition, breaks it), counted by the step the agents take.
            run, accepted = step(
                Run(observed.serving, record.streak),
                side(observed, unhealthy_decides=True),
                Thresholds(self.settings.failure_threshold, self.settings.success_threshold),
                # Nothing trusted to protect: the observation is taken as it is.
                at_once=current is ServeState.UNKNOWN or current is ServeState.SILENT,
            )
            if not accepted:
                record.streak = run.count
                return None
        record.streak = 0
        record.state = observed
        record.state_since = now
        counts = self._counts
        counts[current] -= 1
        counts[observed] += 1
        return StateChange(record.key, current, observed, source, record.reason, now)

    # -- views --------------------------------------------------------------------------

    def get(self, key: PodKey) -> PodRecord | None:
        return self._records.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> Iterator[PodRecord]:
        return iter(self._records.values())

    def counts(self) -> dict[ServeState, int]:
        """Pods per state; every state appears, zeros included."""
        return {state: self._counts[state] for state in ServeState}

    def now(self) -> float:
        return self._clock()
