"""The agent's watchdog, on a fake clock and a fake sleep (no real waits)."""

from __future__ import annotations

import pytest

from node_agent.watchdog import BEAT_SHARE, Watchdog, watch_forever
from tests.conftest import FakeClock

TIMEOUT = 3.0


def test_a_beating_loop_with_finishing_probes_is_not_stalled() -> None:
    clock = FakeClock()
    dog = Watchdog(TIMEOUT, clock)
    dog.probe_loop_started()
    for _ in range(100):
        clock.advance(0.75)
        dog.loop_beat()
        dog.probed()
        assert dog.stall() is None


def test_an_event_loop_that_stops_beating_is_stalled() -> None:
    clock = FakeClock()
    dog = Watchdog(TIMEOUT, clock)
    clock.advance(TIMEOUT)
    assert dog.stall() is None  # at the timeout, not yet
    clock.advance(0.1)
    assert dog.stall() == "its event loop has not run for 3.1s"


def test_probes_that_stop_finishing_are_stalled_even_while_the_loop_beats() -> None:
    clock = FakeClock()
    dog = Watchdog(TIMEOUT, clock)
    dog.probe_loop_started()
    dog.probe_loop_started()
    for _ in range(4):
        clock.advance(1)
        dog.loop_beat()
    assert dog.stall() == "no probe has finished for 4.0s"
    dog.probed()  # one loop of the two finishing a turn is enough (a shared probe budget)
    assert dog.stall() is None


def test_an_agent_with_no_pod_to_probe_is_not_stalled() -> None:
    clock = FakeClock()
    dog = Watchdog(TIMEOUT, clock)
    dog.probe_loop_started()
    dog.probe_loop_ended()  # the DaemonSet's last pod left the node
    for _ in range(10):
        clock.advance(1)
        dog.loop_beat()
        assert dog.stall() is None


def test_the_thread_looks_every_tenth_of_the_timeout_and_stops_at_the_first_stall() -> None:
    clock = FakeClock()
    dog = Watchdog(TIMEOUT, clock)
    dog.probe_loop_started()
    slept: list[float] = []
    stalls: list[str] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)

    watch_forever(dog, stalls.append, sleep=sleep, clock=clock)
    assert stalls == ["its event loop has not run for 3.3s"]
    assert slept == [pytest.approx(TIMEOUT * BEAT_SHARE)] * 11


def test_a_process_stopped_as_a_whole_is_not_a_stall() -> None:
    """SIGSTOP freezes the watchdog thread too: when it wakes up long after it meant to, the
    event loop, thawed at the same moment, gets a fresh timeout before it is judged."""
    clock = FakeClock()
    dog = Watchdog(TIMEOUT, clock)
    stalls: list[str] = []
    sleeps = 0

    def sleep(seconds: float) -> None:
        nonlocal sleeps
        sleeps += 1
        if sleeps == 2:
            clock.advance(60)  # frozen for a minute in this sleep
        elif sleeps < 20:
            dog.loop_beat()  # the thawed loop beats again
        clock.advance(seconds)

    watch_forever(dog, stalls.append, sleep=sleep, clock=clock)
    assert sleeps == 19 + 10  # never stalled while the loop beat; stalled 3 s after it stopped
    assert stalls == ["its event loop has not run for 3.3s"]
