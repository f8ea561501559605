"""bench/api_latency.py: the slow-API distributions of ``bench/failover.py --api-latency``
parse as documented, and draw what they promise (p99 1 s for both presets)."""

from __future__ import annotations

import pytest

from bench import api_latency


def draws(spec: str, count: int = 200_000) -> list[float]:
    recorder = api_latency.Recorder(api_latency.parse(spec), seed=3)
    return sorted(recorder() for _ in range(count))


def quantile(ordered: list[float], q: float) -> float:
    return ordered[int(q * len(ordered))]


@pytest.mark.parametrize("spec", ["p99-1s", "p99-1s-lognormal"])
def test_the_presets_answer_at_p99_in_one_second(spec: str) -> None:
    ordered = draws(spec)
    assert quantile(ordered, 0.99) == pytest.approx(1.0, rel=0.1)
    assert quantile(ordered, 0.5) == pytest.approx(0.035 if spec == "p99-1s" else 0.03, rel=0.1)


def test_the_mix_is_mostly_fast_and_one_percent_slow() -> None:
    ordered = draws("mix:0.02-0.05,0.01,1-3")
    slow = [x for x in ordered if x >= 1.0]
    assert len(slow) / len(ordered) == pytest.approx(0.01, rel=0.1)
    assert all(1.0 <= x <= 3.0 for x in slow)
    assert all(0.02 <= x <= 0.05 for x in ordered if x < 1.0)


def test_lognormal_is_cut_at_its_cap() -> None:
    ordered = draws("lognormal:0.03,1,2")
    assert ordered[-1] == 2.0


def test_none_never_waits() -> None:
    assert set(draws("none", 100)) == {0.0}


def test_the_recorder_reports_what_it_drew() -> None:
    recorder = api_latency.Recorder(api_latency.parse("p99-1s"), seed=1)
    for _ in range(10_000):
        recorder()
    summary = recorder.summary()
    assert summary["requests"] == 10_000
    assert summary["p50_s"] < summary["p99_s"] <= summary["max_s"] <= 3.0
    assert 0.005 < summary["share_at_least_1s"] < 0.015


@pytest.mark.parametrize(
    "spec",
    [
        "slow",
        "mix:0.02-0.05,0.01",
        "mix:0.05-0.02,0.01,1-3",
        "mix:0.02-0.05,2,1-3",
        "mix:0.02,0.01,1-3",
        "lognormal:1,0.5",
        "lognormal:0.03",
        "none:1",
    ],
)
def test_malformed_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="'"):
        api_latency.parse(spec)
