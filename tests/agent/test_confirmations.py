"""A pod back to SERVING gets its two SERVING reports to the aggregator a tick apart.

The aggregator puts a pod back after ``--success-threshold`` (2) SERVING reports in a row, and
an agent that reports on change sends the change and then its next probe results until that
many have gone (``AgentSettings.reports_per_change``). Modelled here on a fake clock, without
real waits: a DaemonSet agent's probe loop (``PodProbe`` on a grid) puts its results in the
``Outbox``; the stream takes what is due once it has waited its batch window
(``daemonset.BATCH_WINDOW``, 50 ms) after a change; what it takes is what it sends.

Found by bench.endpoints (2026-12-02): in 6 of 64 healed proxy faults the pod came back 17-29 s
after the heal instead of ~1 s, at the agent's next resync. The loop's wait for a tick ended a
millisecond early (uvloop's timers), the turn counted as one before the tick, and the loop
probed again at once for the same tick (about one tick in ten, every pod of the node). Both
SERVING results landed in the outbox before the stream took them; the later replaced the
earlier, yet each counted as one of the two reports. The aggregator got one.
"""

from __future__ import annotations

import itertools
import random

import pytest

from node_agent.daemonset import BATCH_WINDOW
from node_agent.outbox import Outbox
from node_agent.probing import PodProbe
from servehealth_common.probe import ProbeResult
from servehealth_common.states import ServeState
from tests.conftest import FakeClock

S = ServeState
INTERVAL = 0.75
POD = "worker-00"
PROBE_TIME = 0.002  # a healthy proxy answers in milliseconds


class LoopEnded(Exception):
    """Raised by the fake sleep after the last turn."""


class ScriptedProber:
    """Answers each probe with the next of ``states``."""

    def __init__(self, states: list[ServeState]) -> None:
        self._states = iter(states)

    async def probe_confirmed(self, *_: object) -> ProbeResult:
        state = next(self._states)
        return ProbeResult(state, "success" if state.serving else "No replicas.", 200, 0.001)


class Path:
    """The probe loop's clock and sleep (which ends ``early``), when each probe started, the
    outbox, and what the stream sent, with when."""

    def __init__(self, early: float, turns: int) -> None:
        self.early = early
        self.turns = turns
        self.clock = FakeClock()
        self.starts: list[float] = []
        self.outbox = Outbox()
        self.outbox.reports_per_change, self.outbox.reports_per_failure = 2, 1
        self.sent: list[tuple[float, ServeState]] = []

    def on_result(self, result: ProbeResult, changed: bool) -> None:
        self.starts.append(self.clock.now)  # the scripted probe takes no time of its own
        self.outbox.put(POD, None, result, changed)
        self.clock.advance(PROBE_TIME)

    async def sleep(self, delay: float) -> None:
        self.turns -= 1
        if self.turns == 0:
            raise LoopEnded
        if delay >= BATCH_WINDOW:  # the stream's batch window ends within this wait: it sends
            self.clock.advance(BATCH_WINDOW)
            self.sent += [(self.clock.now, r.state) for _, r in self.outbox.take(everything=False)]
            delay -= BATCH_WINDOW
        self.clock.advance(max(0.0, delay - self.early))  # the wait ends a little early

    async def run(self, states: list[ServeState]) -> None:
        probe = PodProbe(
            "http://127.0.0.1:1/-/healthz",
            ScriptedProber(states),  # type: ignore[arg-type]
            interval=INTERVAL,
            confirm_delay=0.1,
            on_result=self.on_result,
            rng=random.Random(1),
            name=POD,
            grid_phase=self.clock() + 0.2,
            clock=self.clock,
            sleep=self.sleep,
        )
        with pytest.raises(LoopEnded):
            await probe.run()


@pytest.mark.parametrize("early", [0.0005, 0.001, 0.003, 0.02])
async def test_on_a_grid_a_wait_that_ends_early_still_probes_once_per_tick(early: float) -> None:
    """A turn that starts a little before its tick is that tick's: the next one waits for the
    tick after it, rather than starting at once for the same tick again."""
    path = Path(early, turns=8)
    await path.run([S.SERVING] * 8)
    gaps = [second - first for first, second in itertools.pairwise(path.starts[1:])]
    assert gaps == pytest.approx([INTERVAL] * len(gaps), abs=1e-6)  # the first is off the grid


@pytest.mark.parametrize("early", [0.0, 0.001])
async def test_a_pod_back_to_serving_gets_both_reports_to_the_aggregator(early: float) -> None:
    states = [S.NOT_READY] * 3 + [S.SERVING] * 8
    path = Path(early, turns=len(states))
    await path.run(states)
    assert [state for _, state in path.sent] == [S.NOT_READY, S.SERVING, S.SERVING], path.sent
    # The second SERVING report goes with the next tick's probe: the aggregator puts the pod
    # back a tick after the first, not at the agent's next resync (30 s).
    (first, _), (second, _) = path.sent[1:]
    assert second - first == pytest.approx(INTERVAL, abs=0.01)
