"""Probe a Ray Serve HTTP proxy over HTTP (an adapter of :mod:`http` around :mod:`classify`).

Used by the node agent for its own pods and, as the pull fallback, by the aggregator.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from servehealth_common import classify
from servehealth_common.http import MAX_BODY_BYTES, HTTPClient, HTTPClientError
from servehealth_common.states import ServeState

__all__ = ["MAX_BODY_BYTES", "ProbeResult", "Prober", "make_session", "routes_url"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    state: ServeState
    reason: str
    http_status: int  # 0 when no HTTP answer was received
    latency: float  # seconds

    @property
    def serving(self) -> bool:
        return self.state is ServeState.SERVING


def routes_url(healthz_url: str) -> str:
    """``http://host:port/-/routes`` for a ``.../-/healthz`` URL."""
    return urlsplit(healthz_url)._replace(path="/-/routes", query="", fragment="").geturl()


def make_session(*, max_idle: int = 256, max_idle_per_host: int = 2) -> HTTPClient:
    """The HTTP client of a :class:`Prober`: keeps at most ``max_idle_per_host`` idle
    connections to each proxy (two: a probe and its hedged confirmation), ``max_idle`` in all.
    Requests in flight are bounded by the Prober's ``concurrency``, not here."""
    return HTTPClient(max_idle=max_idle, max_idle_per_host=max_idle_per_host)


class Prober:
    """Answers "what state is the proxy at this URL in?" within ``timeout`` seconds.

    With ``concurrency``, at most that many probes are in flight; a probe waiting for its turn
    has not started yet (its timeout and latency begin when it does).
    """

    def __init__(
        self,
        session: HTTPClient,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        concurrency: int = 0,
    ) -> None:
        self._session = session
        self._timeout = timeout
        self._clock = clock
        self._slots = asyncio.Semaphore(concurrency) if concurrency > 0 else None

    async def probe(self, healthz_url: str) -> ProbeResult:
        if self._slots is None:
            return await self._probe(healthz_url)
        async with self._slots:
            return await self._probe(healthz_url)

    async def _probe(self, healthz_url: str) -> ProbeResult:
        started = self._clock()
        status = 0
        try:
            async with asyncio.timeout(self._timeout):
                status, body = await self._get(healthz_url)
                verdict = classify.classify_healthz(status, body)
                if verdict.state is ServeState.SERVING:
                    # The routes answer decides now; report its status if it is not a 200.
                    routes_status, routes_body = await self._get(routes_url(healthz_url))
                    verdict = classify.classify_routes(routes_status, routes_body)
                    if routes_status != 200:
                        status = routes_status
        except TimeoutError:  # before OSError, of which it is a subclass
            verdict = classify.timed_out(self._timeout)
        except ConnectionRefusedError:
            verdict = classify.connection_refused()
        except (OSError, HTTPClientError) as error:
            verdict = classify.transport_error(error)
        return ProbeResult(verdict.state, verdict.reason, status, self._clock() - started)

    async def probe_confirmed(
        self, healthz_url: str, previous: ServeState | None, confirm_delay: float
    ) -> ProbeResult:
        """A probe whose failure, if it would change ``previous``, is confirmed by a second
        probe started ``confirm_delay`` after the first (the second answer is the one that
        counts). A first probe still unanswered by then gets its confirmation started at once
        (hedged), so a hung proxy costs one timeout plus the delay, not two timeouts."""
        first = asyncio.ensure_future(self.probe(healthz_url))
        done, _ = await asyncio.wait((first,), timeout=confirm_delay)
        if not done:
            second = asyncio.ensure_future(self.probe(healthz_url))
            try:
                result = await first
            except BaseException:
                second.cancel()
                raise
            if result.serving or result.state is previous:
                second.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await second
                return result
            return await second
        result = first.result()
        if result.serving or result.state is previous:
            return result
        await asyncio.sleep(confirm_delay)
        return await self.probe(healthz_url)

    async def _get(self, url: str) -> tuple[int, str]:
        status, body = await self._session.get(url)
        return status, body.decode(errors="replace")
