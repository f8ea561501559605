"""The Kubernetes API's two time formats, as both programs write them (pure)."""

from __future__ import annotations

import datetime


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def api_time(when: datetime.datetime) -> str:
    """RFC 3339 in whole seconds, as the API keeps a condition's and an Event's times (a time
    without an offset is taken as UTC)."""
    if when.tzinfo is not None:
        when = when.astimezone(datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(when: datetime.datetime) -> str:
    """RFC 3339 with microseconds, as the API's ``MicroTime`` (a Lease's ``renewTime``):
    ``2024-05-01T12:00:00.123456Z``."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime.datetime | None:
    """An RFC 3339 time (``Z`` or an offset, with or without a fraction of a second), None if
    it is not one; a time without an offset is taken as UTC."""
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)
