"""The slow-API failover options (issue 28, point 9) cannot rot: ``bench/failover.py`` with
``--api-latency``, the lease timings and a quiet phase completes and reports its churn, its
kills and the delays it injected; ``bench/leader_churn_sim.py`` simulates an hour in seconds.
No figure is asserted beyond sanity (docs/benchmarks.md has them)."""

from __future__ import annotations

from pathlib import Path

from tests.bench.test_smoke import run


def test_failover_on_a_slow_api_smoke(tmp_path: Path) -> None:
    report = run(
        tmp_path,
        "failover",
        *("--api-latency", "p99-1s", "--quiet", "4", "--kills", "1", "--pods", "4"),
        *("--steady", "0.5", "--lease-duration", "4", "--renew-deadline", "3"),
        *("--retry-period", "500ms", "--target", "0"),
    )
    assert report["timings"]["lease_duration_s"] == 4  # type: ignore[index]
    assert report["timings"]["renew_deadline_s"] == 3  # type: ignore[index]
    churn = report["churn"]
    assert churn["seconds"] >= 4  # type: ignore[index]
    assert churn["lease_requests"] > 0  # type: ignore[index]
    for key in ("leadership_losses", "holder_changes", "leaderless_s", "renew_failures"):
        assert key in churn, key  # type: ignore[operator]
    drawn = report["api_latency"]["drawn"]  # type: ignore[index]
    assert drawn["requests"] > 0
    assert 0.02 <= drawn["p50_s"] <= 0.05
    (kill,) = report["kills"]  # type: ignore[misc]
    assert 3 <= kill["serving_s"] <= kill["agents_s"] < 30  # a 4 s lease ages out first
    assert report["spurious_writes"] == 0
    assert "load average" in report["uptime_before"]  # type: ignore[operator]


def test_leader_churn_simulation_smoke(tmp_path: Path) -> None:
    report = run(
        tmp_path,
        "leader_churn_sim",
        *("--hours", "0.5", "--settings", "3/2/0.5,15/10/2"),
        *("--api-latency", "mix:0.02-0.05,0.2,1-3"),  # slow enough to lose in half an hour
    )
    short, long = report["results"]  # type: ignore[misc]
    assert short["settings"] == "3/2/0.5"
    assert short["losses"] > 0
    assert short["lease_calls"] > 1000
    assert long["losses"] < short["losses"]
