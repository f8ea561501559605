"""The project's own errors for Kubernetes API calls (kopf's habit: no client exception leaks).

:func:`wrap` turns whatever the official client or urllib3 raised into one of these, so that
the rest of the code (aggregator and agent) decides on types, never on status codes or library
classes.
"""

from __future__ import annotations

import json
from email.utils import parsedate_to_datetime
from typing import Any

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException


class APIError(Exception):
    """A Kubernetes API call failed. ``status`` is the HTTP status (0: no answer)."""

    retryable = False

    def __init__(self, message: str, status: int = 0, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class APINotFoundError(APIError):
    """404: the object (or the resource) does not exist."""


class APIConflictError(APIError):
    """409: a stale resourceVersion, or a create of an existing object."""


class APIForbiddenError(APIError):
    """401/403: the ServiceAccount may not do this (RBAC)."""


class APIGoneError(APIError):
    """410: a watch or list from a resourceVersion that is no longer available."""


class APIRetryableError(APIError):
    """429, 5xx, a timeout or a broken connection: try again later."""

    retryable = True


class APIClientError(APIError):
    """Any other 4xx: the request itself is wrong; retrying will not help."""


def _message(error: ApiException) -> str:
    try:
        status = json.loads(error.body or "")
        return str(status.get("message") or error.reason)
    except (ValueError, AttributeError):
        return str(error.reason or error.body or "")


def parse_retry_after(value: Any) -> float | None:
    """``Retry-After`` is seconds, or an HTTP date (RFC 9110); None when absent or unparseable."""
    if value is None:
        return None
    text = str(value).strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        from datetime import UTC, datetime

        return max(0.0, (parsedate_to_datetime(text) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None


def wrap(error: BaseException, what: str) -> APIError:
    """The project error for ``error`` raised while doing ``what`` (e.g. "patch pod ns/name")."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ApiException):
        status = int(error.status or 0)
        headers = error.headers or {}
        retry_after = parse_retry_after(headers.get("Retry-After"))
        text = f"{what}: HTTP {status}: {_message(error)}"
        if status == 404:
            return APINotFoundError(text, status)
        if status == 409:
            return APIConflictError(text, status)
        if status == 410:
            return APIGoneError(text, status)
        if status in (401, 403):
            return APIForbiddenError(text, status)
        if status == 429 or status >= 500 or status == 0:
            return APIRetryableError(text, status, retry_after)
        return APIClientError(text, status)
    if isinstance(error, (urllib3.exceptions.HTTPError, OSError, TimeoutError)):
        return APIRetryableError(f"{what}: {type(error).__name__}: {error}")
    raise error  # a bug, not an API failure: let it surface
