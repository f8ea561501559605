"""Reading a ServiceAccount token (a JWT) without verifying it: when it expires, whom it is for.

Nothing here is trusted. The aggregator refuses, without asking the API, a token that has
expired or names another audience; any other token it asks the Kubernetes TokenReview API
about, and only then uses its ``exp`` to decide how long to remember the answer. No JWT
library is needed for that: a JWT is ``base64url(header).base64url(claims).signature``.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

#: Longer tokens are refused unread (a projected token is about 1 KiB).
MAX_TOKEN_BYTES = 16 * 1024
#: The details of the UNAUTHENTICATED status that ends a Report stream whose token expired:
#: an expected end (the agent reconnects at once with the token the kubelet rotated in).
TOKEN_EXPIRED = "token expired; reconnect with a fresh token"


def jwt_claims(token: str) -> dict[str, Any] | None:
    """The claims (payload) of a compact JWT, unverified; None if it is not one."""
    if len(token) > MAX_TOKEN_BYTES:
        return None
    parts = token.split(".")
    if len(parts) != 3 or not all(parts):
        return None
    payload = parts[1]
    try:
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        if not raw.lstrip().startswith(b"{"):  # claims are an object (and "[[[[..." recurses)
            return None
        claims = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError):
        return None
    return claims if isinstance(claims, dict) else None


def expiry(claims: dict[str, Any]) -> float | None:
    """The ``exp`` claim (seconds since the epoch) of a token's claims; None without one."""
    exp = claims.get("exp")
    if isinstance(exp, bool) or not isinstance(exp, int | float):
        return None
    return float(exp)
