"""Who is at the other end of a call, and what it may report: the pure part of authentication.

No gRPC and no Kubernetes client here (:mod:`aggregator.guard` is the gRPC adapter, and the
TokenReview call is injected), and every clock is injected. The story of one token::

    bearer token ── jwt_claims: a JWT whose exp is ahead, for our aud? ── no ──> Unauthenticated
         │ yes                                                            (no API call)
         ▼
    ReviewCache (SHA-256 of the token) ── hit ──> the remembered answer (good or bad)
         │ miss (one review per token at a time, however many streams wait for it)
         ▼
    review(token, audience): the TokenReview API
         ├─ API trouble (5xx, timeout, 403 to the aggregator) ──> ReviewUnavailable (not cached)
         ├─ not authenticated, audience not ours ──> Unauthenticated (cached a few seconds)
         └─ authenticated ──> TokenIdentity (cached until exp, at most CACHE_FOR)

    TokenIdentity + hello ── check_hello ── sidecar: the token's pod is the hello's pod
                                    └─ DaemonSet: an allowed ServiceAccount, on the hello's node
    TokenIdentity + each new pod of a DaemonSet stream ── check_pod_node: the pod runs on its node

A token's identity is what a kube-apiserver puts in the TokenReview of a projected (bound)
ServiceAccount token: ``status.user.username`` ``system:serviceaccount:<ns>:<name>`` and
``status.user.extra`` ``authentication.kubernetes.io/pod-name``, ``.../pod-uid`` and, since
Kubernetes 1.30 (ServiceAccountTokenPodNodeInfo), ``.../node-name``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aggregator.metrics import Metrics
from servehealth_common.tokens import expiry, jwt_claims

SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
NODE_NAME = "authentication.kubernetes.io/node-name"

#: A good answer is remembered until the token expires, but no longer than this: a token whose
#: pod was deleted (the API server then refuses it) stops opening streams within 10 minutes.
CACHE_FOR = 600.0
#: A refusal is remembered this long, so that a flood of one bad token makes one API call.
NEGATIVE_CACHE_FOR = 5.0
#: Tokens remembered at most (least recently used first out); a few MiB at most.
CACHE_ENTRIES = 16_384

#: How a new stream or call with an expired token is refused.
ALREADY_EXPIRED = (
    "the token has expired: send the current one (the kubelet rotates the projected token file "
    "well before it expires)"
)

Clock = Callable[[], float]
#: The TokenReview call: (token, audience) -> the TokenReview's JSON. It raises
#: ReviewUnavailable when the API cannot answer (the adapter wraps the client's errors).
Review = Callable[[str, str], Awaitable[Mapping[str, Any]]]


class AuthError(Exception):
    """A call was refused. ``result`` is the metric label of the refusal."""

    result = "error"


class Unauthenticated(AuthError):
    """No token, not a token, not a genuine one, expired, or meant for another audience."""

    result = "unauthenticated"


class PermissionDenied(AuthError):
    """A genuine token that may not do what the call asks (another pod, another node)."""

    result = "permission_denied"


class ReviewUnavailable(AuthError):
    """The TokenReview API did not answer; the caller should retry later."""

    result = "unavailable"


@dataclass(frozen=True, slots=True)
class TokenIdentity:
    """Who a reviewed token belongs to. Only ServiceAccount tokens have a namespace and a
    ServiceAccount; only tokens bound to a pod have a pod (and, since 1.30, a node)."""

    username: str
    namespace: str = ""
    service_account: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    node_name: str = ""

    @property
    def service_account_ref(self) -> str:
        """``NAMESPACE/NAME`` of the ServiceAccount, or "" for another kind of user."""
        return f"{self.namespace}/{self.service_account}" if self.service_account else ""

    def __str__(self) -> str:
        if self.pod_name:
            return f"{self.username} (pod {self.namespace}/{self.pod_name})"
        return self.username


@dataclass(frozen=True, slots=True)
class Verified:
    """A genuine token: whose it is, and when (on the reviewer's clock) it expires."""

    identity: TokenIdentity
    expires_at: float


def _first(extra: Mapping[str, Any], key: str) -> str:
    values = extra.get(key) or []
    if isinstance(values, str):
        return values
    return str(values[0]) if isinstance(values, list) and values else ""


def identity_from_review(review: Mapping[str, Any], audience: str) -> TokenIdentity:
    """The identity a TokenReview answer vouches for, or Unauthenticated.

    ``status.audiences`` must name ``audience``: an API server that is not audience-aware
    answers an empty list, which means "valid for the API server", not for us.
    """
    status = review.get("status") or {}
    if not status.get("authenticated"):
        reason = str(status.get("error") or "not authenticated")[:200]
        raise Unauthenticated(f"the Kubernetes API refused the token: {reason}")
    if audience not in (status.get("audiences") or []):
        raise Unauthenticated(f"the token is not meant for the audience {audience!r}")
    user = status.get("user") or {}
    username = str(user.get("username") or "")
    if not username:
        raise Unauthenticated("the Kubernetes API named no user for the token")
    extra = user.get("extra") or {}
    namespace = service_account = ""
    if username.startswith(SERVICE_ACCOUNT_PREFIX):
        namespace, _, service_account = username.removeprefix(SERVICE_ACCOUNT_PREFIX).partition(":")
    return TokenIdentity(
        username=username,
        namespace=namespace,
        service_account=service_account,
        pod_name=_first(extra, POD_NAME),
        pod_uid=_first(extra, POD_UID),
        node_name=_first(extra, NODE_NAME),
    )


V = TypeVar("V")


class ReviewCache(Generic[V]):
    """At most ``max_entries`` values, each until its own expiry on ``clock``; the least
    recently used one leaves first when full."""

    def __init__(self, clock: Clock, max_entries: int = CACHE_ENTRIES) -> None:
        self._clock = clock
        self._max = max_entries
        self._entries: OrderedDict[bytes, tuple[float, V]] = OrderedDict()

    def get(self, key: bytes) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: bytes, value: V, ttl: float) -> None:
        if ttl <= 0:
            self._entries.pop(key, None)
            return
        self._entries[key] = (self._clock() + ttl, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a shared answer's exception as seen, whether or not anyone else waited for it."""
    if not future.cancelled():
        future.exception()


class TokenReviewer:
    """Tokens in, identities out: checks the expiry locally, then the cache, then the API.

    ``clock`` (monotonic) times the cache and :attr:`Verified.expires_at`; ``wall_clock`` is
    compared with the tokens' ``exp``.
    """

    def __init__(
        self,
        review: Review,
        audience: str,
        metrics: Metrics,
        *,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
    ) -> None:
        self.audience = audience
        self._review = review
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self.cache: ReviewCache[Verified | str] = ReviewCache(clock)
        self._pending: dict[bytes, asyncio.Future[Verified]] = {}

    async def verify(self, token: str) -> Verified:
        """The identity behind ``token``; raises Unauthenticated or ReviewUnavailable."""
        claims = jwt_claims(token) or {}
        exp = expiry(claims)
        if exp is None:
            raise Unauthenticated(
                "the bearer token is not a Kubernetes ServiceAccount token (a JWT with an exp)"
            )
        if exp <= self._wall_clock():
            raise Unauthenticated(ALREADY_EXPIRED)
        # Unverified, to spare the API a review that must fail (the review checks it again):
        # a token for another audience, typically the pod's default API token.
        aud = claims.get("aud")
        if aud is not None and self.audience not in ([aud] if isinstance(aud, str) else aud):
            raise Unauthenticated(
                f"the token is not meant for the audience {self.audience!r} (its aud is "
                f"{str(aud)[:100]}): mount a projected token with that audience"
            )
        key = hashlib.sha256(token.encode()).digest()
        cached = self.cache.get(key)
        if cached is not None:
            self._metrics.token_cache.labels("hit").inc()
            if isinstance(cached, str):  # a refusal: its reason only (no token, no traceback)
                raise Unauthenticated(cached)
            return cached
        self._metrics.token_cache.labels("miss").inc()
        pending = self._pending.get(key)
        if pending is not None:  # someone is asking the API about this very token right now
            return await asyncio.shield(pending)
        future: asyncio.Future[Verified] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self._pending[key] = future
        try:
            verified = await self._ask(key, token, exp)
        except AuthError as error:
            future.set_exception(error)
            raise
        except BaseException:  # cancelled while waiting: the others retry
            future.set_exception(ReviewUnavailable("the token review was interrupted; retry"))
            raise
        finally:
            del self._pending[key]
        future.set_result(verified)
        return verified

    async def _ask(self, key: bytes, token: str, exp: float) -> Verified:
        try:
            review = await self._review(token, self.audience)
        except ReviewUnavailable:
            self._metrics.token_reviews.labels("error").inc()
            raise
        try:
            identity = identity_from_review(review, self.audience)
        except Unauthenticated as error:
            self._metrics.token_reviews.labels("rejected").inc()
            self.cache.put(key, str(error), NEGATIVE_CACHE_FOR)
            raise
        self._metrics.token_reviews.labels("authenticated").inc()
        remaining = exp - self._wall_clock()
        if remaining <= 0:
            raise Unauthenticated(ALREADY_EXPIRED)
        verified = Verified(identity, self._clock() + remaining)
        self.cache.put(key, verified, min(remaining, CACHE_FOR))
        return verified


# -- what a verified identity may report ---------------------------------------------------


def check_hello(
    identity: TokenIdentity,
    *,
    sidecar: bool,
    pod: tuple[str, str] | None,
    pod_uid: str,
    node_name: str,
    node_agents: Collection[str],
    knows_nodes: bool,
) -> str | None:
    """May ``identity`` open this Report stream? Returns the node a DaemonSet stream is bound
    to (None for a sidecar); raises PermissionDenied.

    A sidecar's token must be bound to the pod its hello names (``pod`` is (namespace, name)).
    A DaemonSet agent's token must belong to one of ``node_agents`` (``NAMESPACE/NAME``) and
    name the hello's node; ``knows_nodes`` says whether the backend knows each pod's node
    (without that, no report of a DaemonSet agent could be checked, so none is accepted).
    """
    if not identity.service_account:
        raise PermissionDenied(
            f"{identity.username} is not a ServiceAccount: only the projected ServiceAccount "
            "tokens of agents may report"
        )
    if sidecar:
        _check_sidecar(identity, pod, pod_uid)
        return None
    _check_node_agent(identity, node_name, node_agents, knows_nodes)
    return identity.node_name


def _check_sidecar(identity: TokenIdentity, pod: tuple[str, str] | None, pod_uid: str) -> None:
    """A sidecar's token is bound to the pod its hello names, uid included."""
    if not identity.pod_name:
        raise PermissionDenied(
            f"the token of ServiceAccount {identity.service_account_ref} is not bound to a "
            "pod: mount a projected serviceAccountToken volume in the agent's pod"
        )
    if pod != (identity.namespace, identity.pod_name):
        named = f"{pod[0]}/{pod[1]}" if pod else "no pod"
        raise PermissionDenied(
            f"the token of pod {identity.namespace}/{identity.pod_name} may not report for "
            f"{named}: a sidecar reports only for its own pod"
        )
    if identity.pod_uid and pod_uid != identity.pod_uid:
        # Also an empty one: the name alone could be a new pod's, the token an old one's.
        raise PermissionDenied(
            f"hello.pod.uid {pod_uid or '(empty)'} is not the uid of the token's pod "
            f"{identity.namespace}/{identity.pod_name} ({identity.pod_uid})"
        )


def _check_node_agent(
    identity: TokenIdentity, node_name: str, node_agents: Collection[str], knows_nodes: bool
) -> None:
    """A DaemonSet agent's token is one of ``node_agents`` and names the hello's node."""
    if identity.service_account_ref not in node_agents:
        raise PermissionDenied(
            f"ServiceAccount {identity.service_account_ref} may not report as a DaemonSet "
            "agent (not an --auth-node-agent-service-account); it may report only for its "
            "own pod, in sidecar mode"
        )
    if not identity.node_name:
        raise PermissionDenied(
            f"the token of ServiceAccount {identity.service_account_ref} names no node "
            f"({NODE_NAME}: a token bound to a pod, from Kubernetes 1.30 on)"
        )
    if node_name != identity.node_name:
        raise PermissionDenied(
            f"hello.node_name {node_name!r} is not the node of the token's pod "
            f"({identity.node_name})"
        )
    if not knows_nodes:
        raise PermissionDenied(
            "DaemonSet agents can be bound to their node only with --kube-backend kubernetes "
            "(the memory backend does not know which node a pod runs on)"
        )


def check_pod_node(node: str, pod: str, pod_node: str | None) -> bool:
    """May the DaemonSet agent of ``node`` report for ``pod``, which runs on ``pod_node``?

    None: a pod the backend does not know, whose report it skips anyway (True). "": a pod not
    scheduled yet as far as the backend has seen (False: skip this report, ask again on the
    next; a lagging watch must not end a whole node's stream). Another node: PermissionDenied.
    """
    if pod_node is None:
        return True
    if not pod_node:
        return False
    if pod_node != node:
        raise PermissionDenied(
            f"a DaemonSet agent on node {node} may not report for pod {pod}, which runs on "
            f"node {pod_node}"
        )
    return True
