"""The pure parts of agent authentication, with fake clocks and a fake TokenReview call.

- ``servehealth_common.tokens``: a JWT's ``exp`` read without verification (and refusals of
  anything that is not a JWT).
- ``identity_from_review``: what a TokenReview answer vouches for (user, pod, node, audience).
- ``ReviewCache``: per-entry expiry on an injected clock, least recently used out when full.
- ``TokenReviewer``: local expiry check, cache hits, negative caching, the 10-minute cap, API
  trouble never cached, one review per token however many streams wait for it.
- ``check_hello`` / ``check_pod_node``: which identity may report for which pod (a table).
- ``guard.bearer_token``: the ``authorization`` call metadata.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping
from typing import Any

import pytest

from aggregator.auth import (
    ALREADY_EXPIRED,
    NODE_NAME,
    POD_NAME,
    POD_UID,
    PermissionDenied,
    ReviewCache,
    ReviewUnavailable,
    TokenIdentity,
    TokenReviewer,
    Unauthenticated,
    check_hello,
    check_pod_node,
    identity_from_review,
)
from aggregator.guard import bearer_token
from aggregator.metrics import Metrics
from servehealth_common.tokens import MAX_TOKEN_BYTES, expiry, jwt_claims
from tests.conftest import FakeClock

AUDIENCE = "ray-serve-health"
NOW = 1_800_000_000.0  # the fake wall clock


def jwt(claims: Mapping[str, Any] | str) -> str:
    def part(data: Any) -> str:
        raw = data.encode() if isinstance(data, str) else json.dumps(data).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


def review(
    username: str = "system:serviceaccount:ray:agent",
    *,
    authenticated: bool = True,
    audiences: list[str] | None = None,
    error: str = "",
    **extra: str,
) -> dict[str, Any]:
    status: dict[str, Any] = {"user": {}}
    if authenticated:
        status.update(
            authenticated=True,
            audiences=[AUDIENCE] if audiences is None else audiences,
            user={"username": username, "extra": {k: [v] for k, v in extra.items()}},
        )
    if error:
        status["error"] = error
    return {"kind": "TokenReview", "status": status}


# -- JWT expiry ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        pytest.param(jwt({"exp": 1_800_000_123}), 1_800_000_123.0, id="exp"),
        pytest.param(jwt({"exp": 17.5}), 17.5, id="fractional"),
        pytest.param(jwt({"aud": ["x"]}), None, id="no-exp"),
        pytest.param(jwt({"exp": "soon"}), None, id="exp-not-a-number"),
        pytest.param(jwt({"exp": True}), None, id="exp-boolean"),
        pytest.param(jwt("[1, 2]"), None, id="claims-not-an-object"),
        pytest.param(jwt("not json"), None, id="claims-not-json"),
        pytest.param(jwt("[" * 5000), None, id="deeply-nested"),  # RecursionError in json
        pytest.param("abc.%%%.def", None, id="not-base64"),
        pytest.param("only.two", None, id="two-parts"),
        pytest.param("a..c", None, id="empty-part"),
        pytest.param("", None, id="empty"),
        pytest.param("x" * (MAX_TOKEN_BYTES + 1), None, id="too-long"),
    ],
)
def test_jwt_expiry_reads_exp_without_verifying(token: str, expected: float | None) -> None:
    assert expiry(jwt_claims(token) or {}) == expected


def test_jwt_claims() -> None:
    token = jwt({"exp": 5, "sub": "system:serviceaccount:a:b"})
    assert jwt_claims(token) == {"exp": 5, "sub": "system:serviceaccount:a:b"}


# -- the TokenReview answer ------------------------------------------------------------------


def test_identity_of_a_pod_bound_service_account_token() -> None:
    answer = review(**{POD_NAME: "p1", POD_UID: "u1", NODE_NAME: "n1"})
    assert identity_from_review(answer, AUDIENCE) == TokenIdentity(
        username="system:serviceaccount:ray:agent",
        namespace="ray",
        service_account="agent",
        pod_name="p1",
        pod_uid="u1",
        node_name="n1",
    )


def test_identity_of_a_user_that_is_no_service_account() -> None:
    identity = identity_from_review(review("alice@example.com"), AUDIENCE)
    assert identity == TokenIdentity("alice@example.com")
    assert identity.service_account_ref == ""


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        pytest.param(
            review(authenticated=False, error="[invalid bearer token, token lookup failed]"),
            "token lookup failed",
            id="not-authenticated",
        ),
        pytest.param({"status": {}}, "not authenticated", id="empty-status"),
        pytest.param({}, "not authenticated", id="no-status"),
        pytest.param(review(audiences=["other"]), "audience", id="other-audience"),
        # Not audience-aware: "valid for the API server", not for us.
        pytest.param(review(audiences=[]), "audience", id="no-audiences"),
        pytest.param(review(""), "no user", id="no-username"),
    ],
)
def test_refused_reviews_are_unauthenticated(answer: dict[str, Any], message: str) -> None:
    with pytest.raises(Unauthenticated, match=message):
        identity_from_review(answer, AUDIENCE)


# -- the cache --------------------------------------------------------------------------------


def test_cache_entries_expire_on_the_injected_clock() -> None:
    clock = FakeClock()
    cache: ReviewCache[str] = ReviewCache(clock, max_entries=10)
    cache.put(b"a", "A", ttl=10)
    cache.put(b"b", "B", ttl=0)  # not kept at all
    clock.advance(9.9)
    assert cache.get(b"a") == "A"
    assert cache.get(b"b") is None
    clock.advance(0.1)
    assert cache.get(b"a") is None
    assert len(cache) == 0


def test_cache_drops_the_least_recently_used_when_full() -> None:
    clock = FakeClock()
    cache: ReviewCache[int] = ReviewCache(clock, max_entries=2)
    cache.put(b"a", 1, ttl=60)
    cache.put(b"b", 2, ttl=60)
    assert cache.get(b"a") == 1  # "a" is now the most recently used
    cache.put(b"c", 3, ttl=60)
    assert (cache.get(b"a"), cache.get(b"b"), cache.get(b"c")) == (1, None, 3)


# -- the reviewer -----------------------------------------------------------------------------


class FakeApi:
    """The injected TokenReview call: answers from ``answers`` (a review, or an exception)."""

    def __init__(self, *answers: dict[str, Any] | BaseException) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, token: str, audience: str) -> Mapping[str, Any]:
        self.calls.append((token, audience))
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def reviewer(api: FakeApi, clock: FakeClock, wall: FakeClock) -> TokenReviewer:
    return TokenReviewer(api, AUDIENCE, Metrics("test"), clock=clock, wall_clock=wall)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def wall() -> FakeClock:
    return FakeClock(NOW)


def counter(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(f"serve_health_{name}_total", labels)
    return value or 0.0


async def test_a_good_token_is_reviewed_once_then_answered_from_the_cache(
    clock: FakeClock, wall: FakeClock
) -> None:
    api = FakeApi(review(**{POD_NAME: "p1"}))
    checker = reviewer(api, clock, wall)
    token = jwt({"exp": NOW + 3600})
    first = await checker.verify(token)
    assert first.identity.pod_name == "p1"
    assert first.expires_at == clock.now + 3600  # the token's exp, on the monotonic clock
    clock.advance(599)
    wall.advance(599)
    assert await checker.verify(token) == first
    assert api.calls == [(token, AUDIENCE)]
    metrics = checker._metrics
    assert counter(metrics, "token_reviews", result="authenticated") == 1
    assert counter(metrics, "token_cache", result="hit") == 1
    assert counter(metrics, "token_cache", result="miss") == 1


async def test_the_cache_keeps_an_answer_at_most_ten_minutes(
    clock: FakeClock, wall: FakeClock
) -> None:
    """A token whose pod was deleted is refused by the API server: within 10 minutes, we too
    stop taking it for new streams."""
    api = FakeApi(review(), review(authenticated=False, error="invalidated"))
    checker = reviewer(api, clock, wall)
    token = jwt({"exp": NOW + 3600})
    await checker.verify(token)
    clock.advance(600)
    wall.advance(600)
    with pytest.raises(Unauthenticated, match="invalidated"):
        await checker.verify(token)
    assert len(api.calls) == 2


async def test_a_short_lived_token_is_cached_only_until_it_expires(
    clock: FakeClock, wall: FakeClock
) -> None:
    api = FakeApi(review())
    checker = reviewer(api, clock, wall)
    token = jwt({"exp": NOW + 30})
    assert (await checker.verify(token)).expires_at == clock.now + 30
    clock.advance(30)
    wall.advance(30)
    with pytest.raises(Unauthenticated) as refused:
        await checker.verify(token)
    assert str(refused.value) == ALREADY_EXPIRED
    assert len(api.calls) == 1  # the expiry is seen locally: no API call


@pytest.mark.parametrize(
    "token",
    [
        pytest.param("not-a-jwt", id="garbled"),
        pytest.param(jwt({"sub": "x"}), id="no-exp"),
        pytest.param(jwt({"exp": NOW - 1}), id="expired"),
        pytest.param(jwt({"exp": NOW}), id="expires-now"),
        pytest.param(jwt({"exp": NOW + 60, "aud": ["https://kubernetes.default.svc"]}), id="aud"),
        pytest.param(jwt({"exp": NOW + 60, "aud": "vault"}), id="aud-string"),
    ],
)
async def test_tokens_refused_without_asking_the_api(
    token: str, clock: FakeClock, wall: FakeClock
) -> None:
    api = FakeApi(review())
    with pytest.raises(Unauthenticated):
        await reviewer(api, clock, wall).verify(token)
    assert api.calls == []


async def test_a_refusal_is_cached_for_a_few_seconds(clock: FakeClock, wall: FakeClock) -> None:
    api = FakeApi(review(authenticated=False, error="token lookup failed"), review())
    checker = reviewer(api, clock, wall)
    token = jwt({"exp": NOW + 3600})
    for _ in range(3):  # a flood of one bad token: one API call
        with pytest.raises(Unauthenticated, match="lookup failed"):
            await checker.verify(token)
    assert len(api.calls) == 1
    clock.advance(5)
    assert (await checker.verify(token)).identity.namespace == "ray"
    assert len(api.calls) == 2
    assert counter(checker._metrics, "token_reviews", result="rejected") == 1


async def test_a_cached_refusal_keeps_only_its_reason(clock: FakeClock, wall: FakeClock) -> None:
    api = FakeApi(review(authenticated=False, error="token lookup failed"))
    checker = reviewer(api, clock, wall)
    with pytest.raises(Unauthenticated):
        await checker.verify(jwt({"exp": NOW + 3600}))
    # Not the exception: its traceback would keep the token (and the call) alive.
    (entry,) = checker.cache._entries.values()
    assert isinstance(entry[1], str)


async def test_api_trouble_is_unavailable_and_not_cached(clock: FakeClock, wall: FakeClock) -> None:
    api = FakeApi(ReviewUnavailable("HTTP 500"), review())
    checker = reviewer(api, clock, wall)
    token = jwt({"exp": NOW + 3600})
    with pytest.raises(ReviewUnavailable):
        await checker.verify(token)
    assert (await checker.verify(token)).identity.service_account == "agent"
    assert len(api.calls) == 2
    assert counter(checker._metrics, "token_reviews", result="error") == 1


async def test_concurrent_checks_of_one_token_make_one_api_call(
    clock: FakeClock, wall: FakeClock
) -> None:
    api = FakeApi(review())
    api.gate = asyncio.Event()
    checker = reviewer(api, clock, wall)
    token = jwt({"exp": NOW + 3600})
    checks = [asyncio.ensure_future(checker.verify(token)) for _ in range(5)]
    await asyncio.sleep(0)  # all five are waiting: one on the API, four on its answer
    api.gate.set()
    results = await asyncio.gather(*checks)
    assert len(api.calls) == 1
    assert len({id(result) for result in results}) == 1


async def test_a_cancelled_check_lets_the_others_retry(clock: FakeClock, wall: FakeClock) -> None:
    api = FakeApi(review())
    api.gate = asyncio.Event()
    checker = reviewer(api, clock, wall)
    token = jwt({"exp": NOW + 3600})
    first = asyncio.ensure_future(checker.verify(token))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(checker.verify(token))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(ReviewUnavailable, match="interrupted"):
        await second
    with pytest.raises(asyncio.CancelledError):
        await first
    api.gate.set()
    assert (await checker.verify(token)).identity.namespace == "ray"


# -- who may report for what ------------------------------------------------------------------

SIDECAR = TokenIdentity(
    "system:serviceaccount:ray:default", "ray", "default", "p1", "uid-p1", node_name="n1"
)
NODE_AGENT = TokenIdentity(
    "system:serviceaccount:ops:ray-serve-health-agent",
    "ops",
    "ray-serve-health-agent",
    "agent-x",
    "uid-x",
    node_name="n1",
)
NODE_AGENTS = frozenset({"ops/ray-serve-health-agent"})


def hello_check(identity: TokenIdentity, **hello: Any) -> str | None:
    values: dict[str, Any] = {
        "sidecar": True,
        "pod": ("ray", "p1"),
        "pod_uid": "uid-p1",  # the sidecar's own (SIDECAR's token is bound to it)
        "node_name": "n1",
        "node_agents": NODE_AGENTS,
        "knows_nodes": True,
        **hello,
    }
    return check_hello(identity, **values)


@pytest.mark.parametrize(
    ("identity", "hello", "expected"),
    [
        pytest.param(SIDECAR, {}, None, id="sidecar-own-pod"),
        pytest.param(SIDECAR, {"knows_nodes": False}, None, id="sidecar-memory-backend"),
        pytest.param(NODE_AGENT, {"sidecar": False, "pod": None}, "n1", id="daemonset-own-node"),
    ],
)
def test_allowed_hellos(
    identity: TokenIdentity, hello: dict[str, Any], expected: str | None
) -> None:
    assert hello_check(identity, **hello) == expected


@pytest.mark.parametrize(
    ("identity", "hello", "message"),
    [
        pytest.param(SIDECAR, {"pod": ("ray", "p2")}, "may not report for ray/p2", id="other-pod"),
        pytest.param(
            SIDECAR, {"pod": ("other", "p1")}, "may not report for other/p1", id="other-namespace"
        ),
        pytest.param(SIDECAR, {"pod_uid": "uid-old"}, "not the uid", id="replaced-pod"),
        pytest.param(SIDECAR, {"pod_uid": ""}, r"\(empty\) is not the uid", id="no-uid"),
        pytest.param(
            TokenIdentity("system:serviceaccount:ray:default", "ray", "default"),
            {},
            "not bound to a pod",
            id="token-of-no-pod",
        ),
        pytest.param(
            TokenIdentity("alice"), {}, "not a ServiceAccount", id="not-a-service-account"
        ),
        pytest.param(
            SIDECAR,
            {"sidecar": False, "pod": None},
            "may not report as a DaemonSet agent",
            id="daemonset-not-allow-listed",
        ),
        pytest.param(
            NODE_AGENT,
            {"sidecar": False, "pod": None, "node_name": "n2"},
            "not the node of the token's pod",
            id="daemonset-other-node",
        ),
        pytest.param(
            TokenIdentity(
                "system:serviceaccount:ops:ray-serve-health-agent", "ops", "ray-serve-health-agent"
            ),
            {"sidecar": False, "pod": None},
            "names no node",
            id="daemonset-token-without-node",
        ),
        pytest.param(
            NODE_AGENT,
            {"sidecar": False, "pod": None, "knows_nodes": False},
            "kube-backend kubernetes",
            id="daemonset-memory-backend",
        ),
    ],
)
def test_refused_hellos(identity: TokenIdentity, hello: dict[str, Any], message: str) -> None:
    with pytest.raises(PermissionDenied, match=message):
        hello_check(identity, **hello)


@pytest.mark.parametrize(
    ("pod_node", "allowed"),
    [
        pytest.param("n1", True, id="same-node"),
        pytest.param(None, True, id="unknown-pod"),  # skipped as unknown_pod anyway
        pytest.param("", False, id="unscheduled"),  # this report skipped, the stream kept
    ],
)
def test_daemonset_reports_only_for_pods_on_its_node(pod_node: str | None, allowed: bool) -> None:
    assert check_pod_node("n1", "ray/p", pod_node) is allowed


def test_a_pod_on_another_node_is_permission_denied() -> None:
    with pytest.raises(PermissionDenied, match="may not report for pod ray/p"):
        check_pod_node("n1", "ray/p", "n2")


# -- the call metadata -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        pytest.param([("authorization", "Bearer abc.def.ghi")], "abc.def.ghi", id="bearer"),
        pytest.param([("authorization", "bearer  abc ")], "abc", id="case-and-spaces"),
        pytest.param([("x", "y"), ("authorization", b"Bearer t")], "t", id="bytes"),
    ],
)
def test_bearer_token(metadata: list[tuple[str, Any]], expected: str) -> None:
    assert bearer_token(metadata) == expected


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param(None, id="no-metadata"),
        pytest.param([("x-other", "Bearer t")], id="no-authorization"),
        pytest.param([("authorization", "Basic dXNlcjpwdw==")], id="basic"),
        pytest.param([("authorization", "Bearer ")], id="empty-token"),
        pytest.param([("authorization", "Bearer a"), ("authorization", "Bearer b")], id="two"),
    ],
)
def test_bad_authorization_metadata_is_unauthenticated(
    metadata: list[tuple[str, Any]] | None,
) -> None:
    with pytest.raises(Unauthenticated):
        bearer_token(metadata)
