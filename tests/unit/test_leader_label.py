"""``aggregator.leader.label`` and ``lifecycle.not_ready``: the leader's label on its own pod.

A fake :class:`OwnPods` (a dict of pod labels, failures queued per call) and a sleep that only
records its delays, so retries take no time: a stale label cleared at start (and readiness
waiting for it), a claim that labels this pod and unlabels a stale leader, retries through API
errors, a drop within its deadline or given up, and the readiness table.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from aggregator.leader.label import LEADER, LeaderLabel, LeaderLabelSettings
from aggregator.lifecycle import Phase, not_ready
from servehealth_common.kube.errors import APIError, APIRetryableError

KEY = "ray-serve-health/leader"


class FakeOwnPods:
    def __init__(self, labels: dict[str, dict[str, str]]) -> None:
        self.labels = labels
        self.failures: list[APIError] = []
        self.calls: list[tuple[str, str, str | None]] = []
        #: While set, set_label waits for it (a call that never answers).
        self.hang: asyncio.Event | None = None

    def describe(self, name: str) -> str:
        return f"ray-serve-health/{name}"

    async def set_label(self, name: str, key: str, value: str | None) -> None:
        self.calls.append((name, key, value))
        if self.hang is not None:
            await self.hang.wait()
        if self.failures:
            raise self.failures.pop(0)
        if value is None:
            self.labels[name].pop(key, None)
        else:
            self.labels[name][key] = value

    async def labelled(self, key: str, value: str) -> list[str]:
        return [name for name, labels in self.labels.items() if labels.get(key) == value]


class RecordedSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def make(pods: FakeOwnPods, sleep: RecordedSleep, drop_within: float = 1.0) -> LeaderLabel:
    return LeaderLabel(
        pods,
        LeaderLabelSettings(KEY, "agg-a", drop_within=drop_within),
        sleep=sleep,
        rng=random.Random(1),
    )


async def test_a_stale_label_is_cleared_at_start_and_readiness_waits_for_it() -> None:
    pods = FakeOwnPods({"agg-a": {KEY: LEADER, "app": "x"}})
    pods.failures = [APIRetryableError("503", 503), APIRetryableError("503", 503)]
    sleep = RecordedSleep()
    label = make(pods, sleep)
    assert not label.settled
    assert not_ready(Phase.STANDBY, label.settled) == (
        "standby: removing a stale leader label from its own pod"
    )
    await label.clear_own()
    assert label.settled
    assert not_ready(Phase.STANDBY, label.settled) is None
    assert pods.labels["agg-a"] == {"app": "x"}
    assert len(sleep.delays) == 2  # two failures, two backoffs
    assert all(0 <= delay <= 5.0 for delay in sleep.delays)


async def test_claim_labels_this_pod_and_unlabels_a_stale_leader() -> None:
    pods = FakeOwnPods({"agg-a": {}, "agg-old": {KEY: LEADER}, "agg-b": {}})
    label = make(pods, RecordedSleep())
    await label.claim()
    assert pods.labels == {"agg-a": {KEY: LEADER}, "agg-old": {}, "agg-b": {}}
    await label.stop()  # leadership ends: removed from this pod
    assert pods.labels["agg-a"] == {}


async def test_drop_does_nothing_without_a_claim() -> None:
    pods = FakeOwnPods({"agg-a": {}})
    await make(pods, RecordedSleep()).stop()
    assert pods.calls == []


async def test_drop_gives_up_after_its_deadline() -> None:
    pods = FakeOwnPods({"agg-a": {}})
    label = make(pods, RecordedSleep(), drop_within=0.05)
    await label.claim()
    pods.hang = asyncio.Event()  # the API no longer answers
    await label.stop()  # returns within drop_within
    assert pods.labels["agg-a"] == {KEY: LEADER}  # the next leader removes it
    pods.hang.set()


async def test_lead_cancels_a_clearing_still_retrying() -> None:
    pods = FakeOwnPods({"agg-a": {KEY: LEADER}})
    pods.hang = asyncio.Event()
    label = make(pods, RecordedSleep())
    label.start()
    await asyncio.sleep(0)  # the clearing is waiting on the API
    pods.hang.set()
    label.lead()
    await label._task  # the claim
    assert pods.labels["agg-a"] == {KEY: LEADER}
    assert label.settled


@pytest.mark.parametrize(
    ("phase", "settled", "ready"),
    [
        pytest.param(Phase.STARTING, True, False, id="starting"),
        pytest.param(Phase.STANDBY, True, True, id="standby"),
        pytest.param(Phase.STANDBY, False, False, id="standby-stale-label"),
        pytest.param(Phase.LEADING, True, True, id="leading"),
        pytest.param(Phase.LEADING, False, True, id="leading-claim-pending"),
        pytest.param(Phase.STEPPING_DOWN, True, False, id="stepping-down"),
        pytest.param(Phase.STOPPING, True, False, id="stopping"),
        pytest.param(Phase.STOPPED, True, False, id="stopped"),
    ],
)
def test_readiness(phase: Phase, settled: bool, ready: bool) -> None:
    assert (not_ready(phase, settled) is None) is ready
