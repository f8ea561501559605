"""The thresholds step both programs take (pure): how many observations in a row on one side
(in service: SERVING; out of service: the others) before that side is accepted
(:func:`step`: :func:`advance` the run, then :func:`accepted`).

``failure_threshold`` observations out of service take a pod out, ``success_threshold``
SERVING ones put it back (hysteresis: the defaults are 1 and 2). The aggregator's tracker
(``aggregator.decision.tracker.Tracker._gate``) and an agent's fallback decider
(``node_agent.fallback.decider.Fallback.observe``, then ``_wanted``) both count with these;
where the two programs differ, they say so with their parameters:

- **UNHEALTHY** (a hang, a timeout, an answer the proxy should never give): the aggregator
  counts it out of service (it leaves service past ``failure_threshold``, after its
  self-protection's look); an agent in fallback fails static: UNHEALTHY decides nothing and
  breaks the run (the pod keeps what it carries). :func:`side` with ``unhealthy_decides``.
- **A first observation**: the aggregator takes the first observation of a pod it knows
  nothing of (UNKNOWN, or SILENT: no observation for its TTL) at once, there being nothing
  trusted to protect; an agent counts its first observations like any (it writes only once
  the thresholds are met). :func:`step` with ``at_once``.

The aggregator's run is of the observations on the other side than its pod's state (an
observation on the state's side, or a transition, breaks it: ``PodRecord.streak``); an
agent's is of its latest results, whatever the pod carries. Both count the same: a change of
side is accepted at the same observation (tests/unit/test_one_thresholds_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from servehealth_common.states import OBSERVABLE_STATES, ServeState


@dataclass(frozen=True, slots=True)
class Run:
    """The latest observations of a pod: their side (True: in service; None: none yet, or the
    last one decided nothing), and how many in a row."""

    serving: bool | None = None
    count: int = 0


#: No run: nothing observed, or the run was broken.
NO_RUN = Run()


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Observations in a row before a pod leaves service (``failure``) or returns to it
    (``success``)."""

    failure: int = 1
    success: int = 2

    def of(self, serving: bool) -> int:
        """The observations in a row that accept side ``serving``."""
        return self.success if serving else self.failure


def side(state: ServeState, *, unhealthy_decides: bool) -> bool | None:
    """The side an observation of ``state`` is on (True: in service, only SERVING), or None
    if it decides nothing and breaks a run.

    ``unhealthy_decides``: the aggregator's tracker (True) puts every state but SERVING out of
    service, UNHEALTHY and its own states (SILENT, UNKNOWN, NO_PROXY_BY_DESIGN) included; an
    agent in fallback (False) decides only by what its probes say of a proxy (SERVING,
    NOT_READY, DRAINING, NO_PROXY): UNHEALTHY, and any state of the aggregator's, decide
    nothing."""
    if unhealthy_decides or (state in OBSERVABLE_STATES and state is not ServeState.UNHEALTHY):
        return state.serving
    return None


def advance(run: Run, serving: bool | None) -> Run:
    """The run after one more observation on side ``serving`` (None: one that decides
    nothing, which breaks the run)."""
    if serving is None:
        return NO_RUN
    return Run(serving, run.count + 1 if run.serving is serving else 1)


def accepted(run: Run, thresholds: Thresholds) -> bool:
    """Whether ``run`` has lasted long enough for its side to be accepted."""
    return run.serving is not None and run.count >= thresholds.of(run.serving)


def step(
    run: Run, serving: bool | None, thresholds: Thresholds, *, at_once: bool = False
) -> tuple[Run, bool]:
    """The run after one more observation on side ``serving`` (:func:`advance`), and whether
    its side is accepted now (:func:`accepted`), or at once where ``at_once`` (the
    aggregator's first observation of a pod it knows nothing of; an agent never passes it: it
    weighs its run with :func:`accepted` when it decides, with the thresholds of that
    moment)."""
    after = advance(run, serving)
    return after, after.serving is not None and (at_once or accepted(after, thresholds))
