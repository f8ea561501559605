"""Where pods come from and where their serve label goes.

A backend answers two questions for the core: may this pod be tracked (``admit``), and make
this pod's label say this (``set_label``). The in-memory backend needs no cluster: pods
register through their agent's hello and labels live in a dict.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

from aggregator.tracker import PodKey

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PodInfo:
    key: PodKey
    uid: str = ""
    node_name: str = ""


class PodRegistry(abc.ABC):
    """The seam between the core and wherever pods live (memory now, Kubernetes later)."""

    name: str

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Begin discovery and writing; the default has nothing to start."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop background work; the default has nothing to stop."""

    @abc.abstractmethod
    def admit(self, pod: PodInfo) -> bool:
        """An agent names ``pod``: may the aggregator track it?"""

    @abc.abstractmethod
    def set_label(self, key: PodKey, value: str) -> None:
        """Make the pod's label say ``value`` (applied in the background by writing backends)."""

    @abc.abstractmethod
    def label(self, key: PodKey) -> str | None:
        """The label value the pod carries now, as far as the backend knows."""

    def forget(self, key: PodKey) -> None:  # noqa: B027 - optional hook
        """The core no longer tracks ``key``."""


class MemoryRegistry(PodRegistry):
    """Every pod an agent names is admitted; labels are kept in this process."""

    name = "memory"

    def __init__(self, label_key: str) -> None:
        self.label_key = label_key
        self._labels: dict[PodKey, str] = {}

    def admit(self, pod: PodInfo) -> bool:
        return True

    def set_label(self, key: PodKey, value: str) -> None:
        if self._labels.get(key) != value:
            self._labels[key] = value
            log.info("label %s=%s on pod %s (memory backend)", self.label_key, value, key)

    def label(self, key: PodKey) -> str | None:
        return self._labels.get(key)

    def forget(self, key: PodKey) -> None:
        self._labels.pop(key, None)
