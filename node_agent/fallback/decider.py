"""The agent as the fallback decider (issue 18): what it writes for its own pods when no
aggregator has accepted its stream for ``--fallback-after`` (pure: no I/O, an injected clock).

The aggregator decides and writes; an agent writes only while no aggregator answers, and only
for its own pods (its sidecar pod, or the pods on its node), what the aggregator would write:

========================================  =========================================
latest probe results                      what is written (only if the pod carries
                                          something else)
========================================  =========================================
``success_threshold`` SERVING in a row    label ``"true"``, condition ``True``
``failure_threshold`` NOT_READY,          label ``"false"``, condition ``False``
DRAINING or NO_PROXY in a row
UNHEALTHY (a hang, a timeout, an          nothing: the pod keeps what it carries
unexpected answer), or fewer in a row     (fail static; a pod that carries nothing
                                          gets nothing)
========================================  =========================================

Like the aggregator's write rule, a pod without the label counts as carrying ``"false"`` and
one without the condition carries nothing; the condition is written only to pods that declare
its type in ``spec.readinessGates``. A manual override (``in-service`` or ``out-of-service``)
decides instead of the probes, as it does for the aggregator: its label is written, whatever
the probes say (another value is ignored, as the aggregator ignores it). Two cases are left
alone: a pod an aggregator of an earlier release told of as overridden without saying which
override, and a pod whose condition says it has no proxy by design (reason
``NoProxyByDesign``) while it still has none (only the aggregator knows where Serve runs no
proxy).

What to write (:class:`WriteRules`) comes from the last aggregator's ``AgentSettings.writes``
(if it allowed fallback), else from the agent's own flags (``--fallback-write``); rules with a
label key KubeRay relies on, or a condition type that is not a readiness gate of ours, are
refused (:func:`refusal`): a crafted setting must not make an agent rewrite another label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from node_agent.fallback.budget import ApiBudget
from node_agent.fallback.lease_gate import LeaseGate, LeaseName
from node_agent.fallback.phase import ALLOWED, FallbackChange, FallbackPhase
from node_agent.fallback.rules import (
    LABELS,
    PodFacts,
    Streak,
    WhosePods,
    Write,
    WriteRules,
    refusal,
)
from servehealth_common.pod_identity import PodKey
from servehealth_common.pod_writes.desired import Desired, Known, desired, override_message
from servehealth_common.pod_writes.rule import NO_PROXY_BY_DESIGN, WriteKind
from servehealth_common.pod_writes.streak import accepted, advance, side
from servehealth_common.states import ServeState

Clock = Callable[[], float]


class Fallback:
    """The fallback decider of one agent: the stream's ups and downs, the write rules, its own
    pods (what each carries) and their probe results in; :meth:`decide` gives the writes."""

    def __init__(
        self,
        *,
        after: float,
        own: WhosePods,
        flag_rules: WriteRules | None,
        clock: Clock,
        lease: LeaseName | None = None,
        budget: ApiBudget | None = None,
    ) -> None:
        self.after = after
        #: When each API request of this agent's fallback may go (None: at once).
        self.budget = budget
        self.own = own
        self._flag_rules = flag_rules
        self._learned: WriteRules | None = None
        self._has_learned = False
        self._clock = clock
        self.phase = FallbackPhase.WAITING
        self._down_since = clock()  # the agent's start counts as a stream's end
        self._began = 0.0
        self._epoch = 0  # fallbacks begun so far
        self._pods: dict[PodKey, PodFacts] = {}
        self._streaks: dict[PodKey, Streak] = {}
        self._dirty: set[PodKey] = set()
        #: Targets whose write failed for good in this fallback, and the value that failed.
        self._given_up: dict[tuple[PodKey, WriteKind], str] = {}
        #: Pods a conditional write found changed (409): their resourceVersion then; no write
        #: for them until a newer version is seen (:meth:`needs_facts`).
        self._stale: dict[PodKey, str] = {}
        #: The gate of issue 26: fallback only while no aggregator renews this Lease.
        self.lease = LeaseGate(lease, clock) if lease is not None else None

    # -- the stream and the rules --------------------------------------------------------

    @property
    def rules(self) -> WriteRules | None:
        """The rules written by: the last aggregator's, once one sent some (None if it did not
        allow fallback, or sent rules that were refused), else the flags' (None: none)."""
        return self._learned if self._has_learned else self._flag_rules

    def learned(self, rules: WriteRules | None) -> str | None:
        """An aggregator's ``AgentSettings.writes``: ``rules``, or None if it does not allow
        fallback. Kept across reconnections. Returns why the rules are refused, if they are."""
        why = refusal(rules) if rules is not None else None
        self._has_learned = True
        self._learned = rules if why is None else None
        return why

    def learned_lease(self, name: LeaseName | None) -> None:
        """The Lease an aggregator's settings name (None: it elects no leader)."""
        if name is None:
            self.lease = None
        elif self.lease is None or self.lease.name != name:
            self.lease = LeaseGate(name, self._clock)

    def stream_up(self) -> FallbackChange | None:
        """An aggregator accepted the stream: fallback ends at once, and writes not yet sent
        are dropped (:meth:`still_wanted`); the Lease is read afresh next time."""
        if self.lease is not None:
            self.lease.forget()
        return self._move(FallbackPhase.CONNECTED)

    def stream_down(self) -> FallbackChange | None:
        if self.phase is not FallbackPhase.CONNECTED:
            return None
        self._down_since = self._clock()
        return self._move(FallbackPhase.WAITING)

    def due(self) -> float | None:
        """When fallback begins (clock time) if no stream is accepted before; None if it
        cannot (a stream is up, fallback is off, already in fallback, or the Lease is being
        read): no stream for ``after`` seconds, and the Lease (if any) not renewed."""
        if self.phase is not FallbackPhase.WAITING or self.after <= 0 or self.rules is None:
            return None
        start = self._down_since + self.after
        if self.lease is None:
            return start
        until = self.lease.renewed_until()
        if until is None:  # not read yet: read from ``start`` on (:meth:`lease_wanted`)
            return start if self._clock() < start else None
        return max(start, until)

    def lease_wanted(self) -> bool:
        """Whether the Lease should be read now: one is named, and fallback is under way, or
        due but for it *and* this agent has something to do (a write it wants, or a pod it
        must read first): an agent whose pods carry what their probes say reads nothing
        (never while a stream is up)."""
        if self.lease is None or self.after <= 0 or self.rules is None:
            return False
        if self.phase is FallbackPhase.FALLBACK:
            return True
        return (
            self.phase is FallbackPhase.WAITING
            and self._clock() >= self._down_since + self.after
            and self.has_work()
        )

    def has_work(self) -> bool:
        """Whether a fallback now would send anything: a write, or a read of a pod first."""
        rules = self.rules
        if rules is None:
            return False
        return any(
            self.needs_facts(key) or any(self._wanted(key, rules))
            for key in self._streaks.keys() | self._pods.keys()
        )

    def tick(self) -> FallbackChange | None:
        """Begin fallback if it is due; end it at once if the Lease is renewed again (an
        aggregator is back, even before it accepts this agent's stream)."""
        if self.phase is FallbackPhase.FALLBACK:
            if self.lease is not None and self.lease.renewed():
                return self._move(FallbackPhase.WAITING)
            return None
        if not self._lease_judged():
            return None  # between two watches of the Lease: wait for the next
        due = self.due()
        if due is None or self._clock() < due:
            return None
        return self._move(FallbackPhase.FALLBACK)

    def seconds_in_fallback(self) -> float:
        return (
            max(0.0, self._clock() - self._began) if self.phase is FallbackPhase.FALLBACK else 0.0
        )

    def _move(self, new: FallbackPhase) -> FallbackChange | None:
        """The one gate of the agent's fallback phases::

                     stream accepted                   stream ended
            WAITING ------------------> CONNECTED -----------------> WAITING
               |     (agent start)          ^
               | no accepted stream for     | stream accepted: writes not yet
               | --fallback-after, and      | sent are dropped
               | rules to write with        |
               v                            |
            FALLBACK -----------------------+
               |
               +--> WAITING: the Lease is renewed again (an aggregator is back)

        With a Lease named, WAITING -> FALLBACK also needs the Lease not renewed
        (:mod:`node_agent.fallback.lease_gate`). Writes are decided only in FALLBACK.
        """
        old, now = self.phase, self._clock()
        if new is old:
            return None
        assert (old, new) in ALLOWED, (old, new)
        self.phase = new
        if new is FallbackPhase.FALLBACK:
            self._began = now
            self._epoch += 1
            self._dirty.update(self._pods)
            return FallbackChange(old, new, now - self._down_since)
        seconds = now - self._began if old is FallbackPhase.FALLBACK else 0.0
        if new is FallbackPhase.CONNECTED or old is FallbackPhase.FALLBACK:
            self._given_up.clear()
        return FallbackChange(old, new, seconds)

    # -- pods and their probes ------------------------------------------------------------

    def pod_seen(self, facts: PodFacts) -> str | None:
        """What a pod carries now (a watch event, a read, the answer to a write). Returns why
        it is not this agent's to write (then it is ignored), or None."""
        why = self.own.refusal(facts)
        if why is not None:
            self._pods.pop(facts.key, None)
            return why
        known = self._pods.get(facts.key)
        if known is None or not facts.earlier_than(known):
            self._pods[facts.key] = facts
            self._dirty.add(facts.key)
            if self._stale.get(facts.key) not in (None, facts.resource_version):
                del self._stale[facts.key]
        return None

    def pod_gone(self, key: PodKey) -> None:
        """The pod is gone, or no longer probed: forget it, its probe results and its writes
        (a write in flight is then no longer wanted: :meth:`still_wanted`)."""
        self._pods.pop(key, None)
        self._streaks.pop(key, None)
        self._dirty.discard(key)
        self._stale.pop(key, None)
        for kind in WriteKind:
            self._given_up.pop((key, kind), None)

    def unseen(self, key: PodKey) -> None:
        """What the pod carries is no longer known (a sidecar stopped watching its pod): no
        write for it until it is seen again; its probe results stay."""
        self._pods.pop(key, None)

    def facts(self, key: PodKey) -> PodFacts | None:
        return self._pods.get(key)

    def needs_facts(self, key: PodKey) -> bool:
        """Whether a write for ``key`` waits on a read of the pod: its probes have decided a
        side, and what it carries is unknown (nobody told), or changed since it was known (a
        conditional write found another version). Only a sidecar reads its pod: a DaemonSet
        agent's watch tells it what its pods carry."""
        streak, rules = self._streaks.get(key), self.rules
        if key != self.own.pod or streak is None or rules is None:
            return False
        if not accepted(streak.run, rules.thresholds):
            return False
        return key not in self._pods or key in self._stale

    def held(self, key: PodKey) -> bool:
        """Whether a manual override, not the probes, decides for ``key`` in this fallback (a
        sidecar then follows its pod, to see the override go)."""
        facts = self._pods.get(key)
        return facts is not None and facts.overridden and self.phase is FallbackPhase.FALLBACK

    def own_pods(self) -> int:
        return len(self._pods)

    def observe(self, key: PodKey, state: ServeState, reason: str = "") -> None:
        """A probe result of ``key`` (every one counts toward the thresholds)."""
        streak = self._streaks.setdefault(key, Streak())
        # The run of results on one side, counted as the aggregator counts it, but for two
        # differences (servehealth_common.pod_writes.streak): UNHEALTHY decides nothing here
        # and breaks the run (fail static; the aggregator counts it out of service), and the
        # first results count like any. The run is weighed against the thresholds when a
        # write is decided (accepted), with the rules of that moment.
        streak.run = advance(streak.run, side(state, unhealthy_decides=False))
        streak.state, streak.reason = state, reason
        self._dirty.add(key)

    # -- the decision ----------------------------------------------------------------------

    def decide(self) -> list[Write]:
        """The writes wanted now for the pods that changed since the last call (none outside
        FALLBACK). The writer queues their pods, once each, and asks :meth:`next_write` when a
        worker takes one (level-triggered: what goes is what the pod should carry then)."""
        rules = self.rules
        if self.phase is not FallbackPhase.FALLBACK or rules is None or not self._lease_judged():
            return []  # (between two watches of the Lease: decided once it is observed again)
        writes = [write for key in sorted(self._dirty) for write in self._wanted(key, rules)]
        self._dirty.clear()
        return writes

    def next_write(self, key: PodKey) -> Write | None:
        """What ``key`` should be written now, first (its label, then its condition), asked
        by the writer's worker when it takes the pod, and again once its slot comes; None
        outside FALLBACK, between two watches of the Lease, or when the pod carries what it
        should (or what it lacks failed for good in this fallback)."""
        return next(iter(self._pending(key)), None)

    def _wanted(self, key: PodKey, rules: WriteRules) -> Iterable[Write]:
        """What ``key`` should be written now, less what failed for good (pure: marks
        nothing)."""
        facts = self._pods.get(key)
        wanted = self._desired(key, rules)
        if facts is None or wanted is None:
            return
        streak = self._streaks.get(key) or Streak()
        names = dict(rules.targets())
        for kind, value in wanted.targets():
            target = (key, kind)
            if kind not in wanted.writes or value == self._given_up.get(target):
                continue
            yield Write(
                key,
                facts.uid,
                kind,
                names[kind],
                value,
                streak.state,
                streak.reason,
                self._epoch,
                facts.resource_version,
                override_message(facts.override) or "",
            )

    def _desired(self, key: PodKey, rules: WriteRules) -> Desired | None:
        """What ``key`` should carry, as the aggregator would have it
        (:func:`~servehealth_common.pod_writes.desired.desired`): the override's label if one
        is honoured, else what its probes decided; None while that is unknown (the pod not
        seen, or changed since a conditional write; an override an aggregator of an earlier
        release told of without saying which: the pod is left alone)."""
        facts, streak = self._pods.get(key), self._streaks.get(key)
        if facts is None or key in self._stale:
            return None
        if facts.overridden and facts.override.value is None:
            return None
        serving = streak.run.serving if streak is not None else None
        decided = streak is not None and accepted(streak.run, rules.thresholds)
        health = LABELS[serving] if serving is not None and decided else None
        condition = facts.carried(WriteKind.CONDITION, rules.condition_type)
        return desired(
            Known(
                health,
                writes_label=bool(rules.label_key),
                writes_condition=bool(rules.condition_type),
                gated=rules.condition_type in facts.readiness_gates,
                override=facts.override,
                # The aggregator judged that no proxy is meant here, and only it has the serve
                # view: the pod keeps that condition.
                by_design=condition == NO_PROXY_BY_DESIGN
                and streak is not None
                and streak.state is ServeState.NO_PROXY,
                label=facts.carried(WriteKind.LABEL, rules.label_key),
                condition=condition,
            )
        )

    def _lease_judged(self) -> bool:
        """Whether the Lease (if any) is observed now, or was never readable (no gate)."""
        return self.lease is None or self.lease.may_judge()

    def in_this_fallback(self, write: Write) -> bool:
        """Whether the fallback that decided ``write`` is still under way (its Event is sent
        only then: nothing is sent once an aggregator is back)."""
        return self.phase is FallbackPhase.FALLBACK and write.epoch == self._epoch

    def still_wanted(self, write: Write) -> bool:
        """Whether ``write`` is still wanted: in the fallback that decided it, on the same pod,
        and still what it should carry (an override may have come or gone, the probes
        changed their mind, or another write made it needless)."""
        if write.epoch != self._epoch:
            return False
        return any(
            (now.kind, now.value, now.uid) == (write.kind, write.value, write.uid)
            for now in self._pending(write.key)
        )

    def _pending(self, key: PodKey) -> Iterable[Write]:
        rules = self.rules
        if self.phase is not FallbackPhase.FALLBACK or rules is None or not self._lease_judged():
            return ()
        return self._wanted(key, rules)

    def finished(
        self,
        write: Write,
        *,
        answer: PodFacts | None = None,
        written: bool = False,
        gave_up: bool = False,
    ) -> None:
        """``write`` is over: ``written`` (``answer``: the pod as the API returned it, if it
        did), dropped, or failed for good (``gave_up``: this value is not tried again for this
        pod until the next fallback)."""
        if write.epoch != self._epoch:
            return  # an earlier fallback's: the pod is read afresh anyway
        if gave_up:
            self._given_up[write.key, write.kind] = write.value
        known = self._pods.get(write.key)
        if answer is not None:
            self.pod_seen(answer)
        elif written and known is not None and known.uid == write.uid:
            self._pods[write.key] = known.carrying(write.kind, write.name, write.value)

    def conflicted(self, write: Write) -> None:
        """``write`` was conditional on the pod's version, and the pod has changed since (409):
        it is over, and ``key`` is written again only once a newer version is seen (a
        sidecar reads it: :meth:`needs_facts`; a DaemonSet agent's watch brings it)."""
        known = self._pods.get(write.key)
        current = write.epoch == self._epoch and known is not None
        if current and known is not None and known.resource_version == write.version:
            self._stale[write.key] = write.version
        self.finished(write)
