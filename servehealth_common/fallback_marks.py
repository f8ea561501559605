"""What an agent in fallback leaves on the pods it writes, so that anyone (an aggregator coming
back, a person with kubectl) can tell its writes from an aggregator's.

- condition mode: the condition's ``reason`` is :data:`CONDITION_REASON` (an aggregator writes
  ``ServeProxyServing``/``ServeProxyNotServing``; it reads a condition by its status, so it
  finds nothing to change when the agent wrote the value it wants), and its message names the
  agent;
- label mode: beside the label, the annotation :data:`ANNOTATION`, whose value is
  ``<RFC 3339 time of the write, with microseconds> <who wrote it>`` (the resolution of the
  Lease's ``renewTime``, which an aggregator taking over compares it with);
- both: an Event on the pod with reason :data:`EVENT_REASON` for every write.

An aggregator that takes over counts the pods whose mark is newer than the last renewal of its
Lease (the moment the aggregators went away): the pods changed by agents while none was there
(:func:`written_after`). A condition's time has whole seconds only (the API server keeps no
fraction of it), and so has an annotation an older agent wrote: such a mark is
compared at its own resolution.
"""

from __future__ import annotations

import datetime

#: The condition reason of an agent's fallback write.
CONDITION_REASON = "NoAggregator"
#: The annotation beside an agent's fallback write of the label: "<time> <writer>".
ANNOTATION = "ray-serve-health/fallback-write"
#: The reason of the Event an agent records for each fallback write.
EVENT_REASON = "NoAggregator"
#: What the log lines and Event messages of fallback writes say, as the issue asked.
WHY = "no aggregator"


def annotation_value(when_rfc3339: str, writer: str) -> str:
    """The annotation's value: the time of the write, then who wrote it."""
    return f"{when_rfc3339} {writer}"


def annotation_time(value: str) -> str:
    """The RFC 3339 time of an annotation's value ("" if it has none)."""
    return value.split(" ", 1)[0] if value else ""


def written_after(mark: datetime.datetime, since: datetime.datetime) -> bool:
    """Whether a write marked ``mark`` may have come after ``since`` (a Lease's renewal, with
    microseconds), compared like with like: a mark without a fraction of a second (a
    condition's time, an older agent's annotation) counts from the start of ``since``'s
    second."""
    if mark.microsecond == 0:
        return mark >= since.replace(microsecond=0)
    return mark > since
