"""The agent's own watchdog: silence must stay a true signal.

The aggregator knows an agent is alive from its connection: HTTP/2 PINGs that the gRPC core
answers on threads of its own. An agent whose event loop is stuck (a blocking call, a log pipe
nobody reads, a busy loop) or whose probes no longer complete would still answer them, and its
pods would keep their last state forever. So the event loop and the probe loops beat
(:class:`Watchdog`), and a thread of its own (:func:`watch_forever`) ends the process when they
stop beating for ``--stall-timeout``: the kernel closes the connection, the aggregator sees
the stream end at once and pulls the pods, and the kubelet restarts the container.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

#: The exit status of an agent stopped by its watchdog (EX_SOFTWARE).
EXIT_STALLED = 70
#: How often the event loop beats and the thread looks, as a share of the timeout.
BEAT_SHARE = 0.1


class Watchdog:
    """What the event loop and the probe loops last did. Written by the event loop, read by
    the watchdog thread (float stores are atomic in CPython). ``clock`` is injected."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self._loop_at = self._probed_at = clock()
        self._probe_loops = 0

    # -- from the event loop ------------------------------------------------------------

    def loop_beat(self) -> None:
        self._loop_at = self._clock()

    def probe_loop_started(self) -> None:
        """A probe loop began (its first probe counts from now)."""
        self._probe_loops += 1
        self._probed_at = self._clock()

    def probe_loop_ended(self) -> None:
        self._probe_loops -= 1

    def probed(self) -> None:
        """A probe loop finished a turn (whatever the probe found)."""
        self._probed_at = self._clock()

    # -- from the watchdog thread ---------------------------------------------------------

    def resumed(self) -> None:
        """The whole process was stopped (SIGSTOP, a paused VM), not only its event loop: the
        loops get a fresh timeout from now."""
        self._loop_at = self._probed_at = self._clock()

    def stall(self) -> str | None:
        """Why the agent is stuck, or None. Probes stall when no probe loop finished a turn
        for the timeout while some run (one turn takes at most an interval and two probe
        timeouts; a DaemonSet agent's loops share a probe budget, so only all of them stuck
        counts); an agent with no pod to probe has no probe to stall."""
        now = self._clock()
        if now - self._loop_at > self.timeout:
            return f"its event loop has not run for {now - self._loop_at:.1f}s"
        if self._probe_loops and now - self._probed_at > self.timeout:
            return f"no probe has finished for {now - self._probed_at:.1f}s"
        return None


async def beat_forever(watchdog: Watchdog) -> None:
    """The event loop's beat (a task of the agent)."""
    while True:
        watchdog.loop_beat()
        await asyncio.sleep(watchdog.timeout * BEAT_SHARE)


def watch_forever(
    watchdog: Watchdog,
    on_stall: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The watchdog thread's body: look every tenth of the timeout; on a stall, call
    ``on_stall`` with the reason and return. If this thread itself did not run for half the
    timeout, the whole process was stopped: the event loop, which resumes with it, gets a fresh
    timeout (it is not the one stuck)."""
    period = watchdog.timeout * BEAT_SHARE
    while True:
        before = clock()
        sleep(period)
        if clock() - before > period + watchdog.timeout / 2:
            watchdog.resumed()
            continue
        reason = watchdog.stall()
        if reason is not None:
            on_stall(reason)
            return


def exit_stalled(reason: str) -> None:
    """End the process now (the event loop cannot be trusted to do it). The message goes to
    stderr from a thread of its own: if stderr is what blocks, the exit does not wait for it."""
    message = (
        f"serve-health-agent: watchdog: {reason} (--stall-timeout); exiting with status "
        f"{EXIT_STALLED} so that the aggregator sees this agent gone and probes its pods\n"
    )
    writer = threading.Thread(target=_write_stderr, args=(message,), daemon=True)
    writer.start()
    writer.join(0.2)
    os._exit(EXIT_STALLED)


def _write_stderr(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), message.encode())


def start(watchdog: Watchdog) -> None:
    """Start the watchdog thread (a daemon: it never keeps the process alive)."""
    threading.Thread(
        target=watch_forever, args=(watchdog, exit_stalled), name="watchdog", daemon=True
    ).start()
