"""Probe a Ray Serve proxy over HTTP (an adapter of :mod:`http` around :mod:`classify`), and
its gRPC proxy too where the pod has gRPC ingress (:mod:`grpc_healthz`).

Used by the node agent for its own pods and, as the pull fallback, by the aggregator (HTTP
only). A failure that would change the state is confirmed by a second probe
(:meth:`Prober.probe_confirmed`); a hung proxy costs one probe timeout (a hedged second probe,
unanswered too, confirms it). With a gRPC address, one probe asks both proxies at once, within
the same timeout, and the pod's state is the worse of the two (:func:`classify.worse_of`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from urllib.parse import urlsplit

from servehealth_common import classify
from servehealth_common.grpc_healthz import GrpcHealthz
from servehealth_common.http import MAX_BODY_BYTES, HTTPClient, HTTPClientError
from servehealth_common.states import ServeState

__all__ = ["MAX_BODY_BYTES", "ProbeResult", "Prober", "make_session", "routes_url"]

#: How late (after its deadline) a probe's timeout may be seen, by default, for an unanswered
#: hedge to confirm a hang. Later, the event loop itself was busy (a pull sweep of thousands of
#: pods, a starved CPU): answers may be waiting unread, so the hedge gets its own timeout.
LOOP_LAG_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class ProbeResult:
    state: ServeState
    reason: str
    http_status: int  # 0 when no HTTP answer was received
    latency: float  # seconds

    @property
    def serving(self) -> bool:
        return self.state is ServeState.SERVING


@dataclass(slots=True)
class _Attempt:
    """When one probe began and ended (by the Prober's clock) and how its timeout went: what
    :meth:`Prober.probe_confirmed` needs beyond the result to call a hang confirmed."""

    started_at: float | None = None  # None: still waiting for a concurrency slot
    ended_at: float | None = None
    #: How long after its deadline the timeout was seen; None: the probe did not time out.
    timeout_seen_late_by: float | None = None

    def hang_confirmed_by(self, hedge: _Attempt, *, hedge_flight: float, lag: float) -> bool:
        """Whether this probe timed out, seen at most ``lag`` late, while ``hedge`` had been
        in flight for at least ``hedge_flight``: both went unanswered. A hedge that waited for
        a concurrency slot has been asked too little, or nothing yet; a timeout seen late
        means the event loop was too busy to tell an unanswered probe from an unread answer."""
        return (
            self.timeout_seen_late_by is not None
            and self.timeout_seen_late_by <= lag
            and self.ended_at is not None
            and hedge.started_at is not None
            and self.ended_at - hedge.started_at >= hedge_flight
        )


def routes_url(healthz_url: str) -> str:
    """``http://host:port/-/routes`` for a ``.../-/healthz`` URL."""
    return urlsplit(healthz_url)._replace(path="/-/routes", query="", fragment="").geturl()


def make_session(*, max_idle: int = 256, max_idle_per_host: int = 2) -> HTTPClient:
    """The HTTP client of a :class:`Prober`: keeps at most ``max_idle_per_host`` idle
    connections to each proxy (two: a probe and its hedged confirmation), ``max_idle`` in all.
    Requests in flight are bounded by the Prober's ``concurrency``, not here."""
    return HTTPClient(max_idle=max_idle, max_idle_per_host=max_idle_per_host)


@dataclass(eq=False)
class Prober:
    """Answers "what state is the proxy at this URL in?" within ``timeout`` seconds.

    With ``concurrency``, at most that many probes are in flight; a probe waiting for its turn
    has not started yet (its timeout and latency begin when it does). ``loop_lag_tolerance``:
    see :meth:`probe_confirmed`. ``grpc``: the client of gRPC ``Healthz`` calls, for probes
    given a ``grpc_address``.
    """

    session: HTTPClient
    timeout: float
    clock: Callable[[], float] = time.monotonic
    _: KW_ONLY
    concurrency: int = 0
    loop_lag_tolerance: float = LOOP_LAG_TOLERANCE
    grpc: GrpcHealthz | None = None

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.concurrency) if self.concurrency > 0 else None

    async def probe(self, healthz_url: str, grpc_address: str | None = None) -> ProbeResult:
        return await self._probe_in_turn(healthz_url, grpc_address, _Attempt())

    async def _probe_in_turn(
        self, healthz_url: str, grpc_address: str | None, attempt: _Attempt
    ) -> ProbeResult:
        if self._slots is None:
            return await self._probe(healthz_url, grpc_address, attempt)
        async with self._slots:
            return await self._probe(healthz_url, grpc_address, attempt)

    async def _probe(
        self, healthz_url: str, grpc_address: str | None, attempt: _Attempt
    ) -> ProbeResult:
        started = attempt.started_at = self.clock()
        if grpc_address is None:
            verdict, status, timed_out = await self._probe_http(healthz_url)
        else:
            (http, status, http_timed_out), (grpc, grpc_timed_out) = await asyncio.gather(
                self._probe_http(healthz_url), self._probe_grpc(grpc_address)
            )
            verdict = classify.worse_of(http, grpc, f"gRPC proxy {grpc_address}")
            # The hang test of probe_confirmed looks at the timeout of the half that decided.
            timed_out = http_timed_out if verdict.state is http.state else grpc_timed_out
        ended = attempt.ended_at = self.clock()
        if timed_out:
            attempt.timeout_seen_late_by = ended - (started + self.timeout)
        return ProbeResult(verdict.state, verdict.reason, status, ended - started)

    async def _probe_http(self, healthz_url: str) -> tuple[classify.Verdict, int, bool]:
        """The HTTP proxy's verdict, the HTTP status that decided it (0: none), and whether
        the probe timed out."""
        status = 0
        try:
            async with asyncio.timeout(self.timeout):
                status, body = await self._get(healthz_url)
                verdict = classify.classify_healthz(status, body)
                if verdict.state is ServeState.SERVING:
                    # The routes answer decides now; report its status if it is not a 200.
                    routes_status, routes_body = await self._get(routes_url(healthz_url))
                    verdict = classify.classify_routes(routes_status, routes_body)
                    if routes_status != 200:
                        status = routes_status
        except TimeoutError:  # before OSError, of which it is a subclass
            return classify.timed_out(self.timeout), status, True
        except ConnectionRefusedError:
            verdict = classify.connection_refused()
        except (OSError, HTTPClientError) as error:
            verdict = classify.transport_error(error)
        return verdict, status, False

    async def _probe_grpc(self, address: str) -> tuple[classify.Verdict, bool]:
        """The gRPC proxy's verdict, and whether the call timed out."""
        if self.grpc is None:
            raise RuntimeError("a gRPC address was given to a Prober without a GrpcHealthz")
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self.grpc.check(address)
        except TimeoutError:
            return classify.timed_out(self.timeout), True
        return answer.verdict, answer.timed_out

    async def probe_confirmed(
        self,
        healthz_url: str,
        previous: ServeState | None,
        confirm_delay: float,
        grpc_address: str | None = None,
    ) -> ProbeResult:
        """One probe; a failure that would change ``previous`` is confirmed by a second one.

        A result that is ``SERVING`` or ``previous`` needs no confirmation. Otherwise:

        - The first probe answered within ``confirm_delay``: the second starts
          ``confirm_delay`` after that answer, and the second answer is the one that counts.
        - The first is still unanswered at ``confirm_delay``: the second (hedged) starts at
          once. If it has answered by the time the first fails, its answer counts. If it is
          still unanswered when the first ends by its timeout, and it has been in flight for
          ``timeout - confirm_delay`` (less ``loop_lag_tolerance``; not if it waited for a
          concurrency slot), two probes went unanswered: the hang is confirmed, the first's
          result is returned at once and the second is cancelled. In any other case (also
          when the first's timeout was seen more than ``loop_lag_tolerance`` late: a busy
          event loop, not the proxy, may have kept the answers) the second's answer is
          awaited and counts.

        So a hung proxy costs one probe timeout, not a timeout plus the delay (nor two).
        """
        first_attempt = _Attempt()
        first = asyncio.ensure_future(self._probe_in_turn(healthz_url, grpc_address, first_attempt))
        try:
            done, _ = await asyncio.wait((first,), timeout=confirm_delay)
        except BaseException:  # cancelled: no probe of this call outlives it
            await _cancel(first)
            raise
        if not done:
            return await self._hedged(
                healthz_url, grpc_address, previous, confirm_delay, first, first_attempt
            )
        result = first.result()
        if result.serving or result.state is previous:
            return result
        await asyncio.sleep(confirm_delay)
        return await self.probe(healthz_url, grpc_address)

    async def _hedged(
        self,
        healthz_url: str,
        grpc_address: str | None,
        previous: ServeState | None,
        confirm_delay: float,
        first: asyncio.Future[ProbeResult],
        first_attempt: _Attempt,
    ) -> ProbeResult:
        """The rest of :meth:`probe_confirmed` once ``first`` outlived the confirm delay."""
        hedge_attempt = _Attempt()
        hedge = asyncio.ensure_future(self._probe_in_turn(healthz_url, grpc_address, hedge_attempt))
        try:
            result = await first
        except BaseException:
            await _cancel(hedge)
            raise
        lag = self.loop_lag_tolerance
        hang_confirmed = not hedge.done() and first_attempt.hang_confirmed_by(
            hedge_attempt, hedge_flight=self.timeout - confirm_delay - lag, lag=lag
        )
        if result.serving or result.state is previous or hang_confirmed:
            await _cancel(hedge)
            return result
        return await hedge

    async def _get(self, url: str) -> tuple[int, str]:
        status, body = await self.session.get(url)
        return status, body.decode(errors="replace")


async def _cancel(task: asyncio.Future[ProbeResult]) -> None:
    """Cancel a probe whose answer is no longer needed and wait until it has ended."""
    task.cancel()
    await asyncio.wait((task,))
