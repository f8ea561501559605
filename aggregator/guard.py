"""The gRPC side of authentication: a call's bearer token in, an identity or a status out.

:mod:`aggregator.auth` decides; this adapter reads the ``authorization: Bearer <token>`` call
metadata, ends a refused call with its status (UNAUTHENTICATED, PERMISSION_DENIED, or
UNAVAILABLE when the TokenReview API could not answer: the agent retries), counts every
decision in ``serve_health_auth_total`` and logs a refusal once per client address and kind
(later ones at debug level), so that a misconfigured fleet does not flood the log.

The check is per stream, never per message: a Report stream is checked once, after its hello,
and ends (UNAUTHENTICATED, :data:`servehealth_common.tokens.TOKEN_EXPIRED`: the agent expects
it, and reconnects at once) when its token expires, so that no stream outlives its token; an
inspection call is checked when it starts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NoReturn

import grpc

from aggregator.auth import (
    AuthError,
    PermissionDenied,
    ReviewUnavailable,
    TokenIdentity,
    TokenReviewer,
    Unauthenticated,
    Verified,
    check_hello,
)
from aggregator.ingest.admission import peer_host
from aggregator.metrics import Metrics
from servehealth.v1 import servehealth_pb2 as pb
from servehealth_common.tokens import TOKEN_EXPIRED

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
#: Client addresses whose refusals were logged (least recently refused first out).
LOGGED_PEERS = 1024

CODES: Mapping[type[AuthError], grpc.StatusCode] = {
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ReviewUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The token of the call's ``authorization: Bearer <token>`` metadata; Unauthenticated
    without exactly one such entry."""
    values = [value for key, value in metadata or () if key == AUTHORIZATION]
    if not values:
        raise Unauthenticated(
            "no token: send the agent's ServiceAccount token as 'authorization: Bearer <token>' "
            "call metadata (serve-health-agent --token-file)"
        )
    if len(values) > 1:
        raise Unauthenticated("more than one authorization entry in the call metadata")
    value = values[0].decode("ascii", "replace") if isinstance(values[0], bytes) else values[0]
    scheme, _, token = str(value).strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
    return token


@dataclass(frozen=True, slots=True)
class StreamGrant:
    """A Report stream that may go on: whose it is, when it must end (the event loop's clock),
    and the node a DaemonSet agent's pods must run on (None for a sidecar)."""

    identity: TokenIdentity
    deadline: float
    node: str | None


@dataclass(eq=False)
class Guard:
    """Token checks for the gRPC services; every refusal ends the call (``context.abort``)."""

    reviewer: TokenReviewer
    metrics: Metrics
    _: KW_ONLY
    #: Whether the backend knows each pod's node (without that, no DaemonSet agent's report
    #: could be bound to its node, so none is accepted).
    knows_nodes: bool
    #: The ServiceAccounts (``NAMESPACE/NAME``) that may report as DaemonSet agents.
    node_agents: Collection[str]
    #: Closes the TokenReview client (on stop).
    close: Callable[[], None]
    #: Client addresses and kinds whose refusal was logged (least recently refused first out).
    _logged: OrderedDict[tuple[str, str, str], None] = field(
        init=False, default_factory=OrderedDict
    )

    # -- the services' entry points -------------------------------------------------------

    async def authenticate(self, context: grpc.aio.ServicerContext) -> Verified:
        """The token of a new Report stream, checked before anything is read from it."""
        try:
            return await self.reviewer.verify(bearer_token(context.invocation_metadata()))
        except AuthError as error:
            await self.refuse(context, "report", error)

    async def bind(
        self, context: grpc.aio.ServicerContext, verified: Verified, hello: pb.Hello
    ) -> StreamGrant:
        """What the stream's (authenticated) token may report, given its (valid) hello."""
        try:
            sidecar = hello.mode == pb.AGENT_MODE_SIDECAR
            node = check_hello(
                verified.identity,
                sidecar=sidecar,
                pod=(hello.pod.namespace, hello.pod.name) if sidecar else None,
                pod_uid=hello.pod.uid,
                node_name=hello.node_name,
                node_agents=self.node_agents,
                knows_nodes=self.knows_nodes,
            )
        except AuthError as error:
            await self.refuse(context, "report", error)
        self.metrics.auth.labels("report", "ok").inc()
        log.debug("report stream from %s: %s", context.peer(), verified.identity)
        return StreamGrant(verified.identity, verified.expires_at, node)

    async def expired(self, context: grpc.aio.ServicerContext) -> NoReturn:
        """End a Report stream whose token expired; the agent reconnects with its new one."""
        self.metrics.auth.labels("report", "expired").inc()
        log.debug("ending the report stream of %s: its token expired", context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, TOKEN_EXPIRED)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    async def admit_call(self, context: grpc.aio.ServicerContext, service: str) -> TokenIdentity:
        """Any genuine token for our audience (inspection is read-only)."""
        try:
            verified = await self.reviewer.verify(bearer_token(context.invocation_metadata()))
        except AuthError as error:
            await self.refuse(context, service, error)
        self.metrics.auth.labels(service, "ok").inc()
        return verified.identity

    # -- refusals -------------------------------------------------------------------------

    async def refuse(
        self, context: grpc.aio.ServicerContext, service: str, error: AuthError
    ) -> NoReturn:
        """End the call with the status of ``error``: counted, and logged once per client
        address and kind."""
        code = CODES.get(type(error), grpc.StatusCode.UNAUTHENTICATED)
        self.metrics.auth.labels(service, error.result).inc()
        peer = context.peer()
        key = (peer_host(peer), service, error.result)
        if key in self._logged:
            self._logged.move_to_end(key)
            log.debug("refusing a %s call from %s: %s: %s", service, peer, code.name, error)
        else:
            self._logged[key] = None
            if len(self._logged) > LOGGED_PEERS:
                self._logged.popitem(last=False)
            log.warning(
                "refusing a %s call from %s: %s: %s (logged once per client address)",
                service,
                peer,
                code.name,
                error,
            )
        await context.abort(code, str(error))
        raise AssertionError("unreachable")  # pragma: no cover - abort raises
