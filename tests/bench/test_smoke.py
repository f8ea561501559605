"""The benchmarks cannot rot: a small ingest run (fifty agents, a few seconds), a short
detection run and a small connection flood complete and report sane numbers. No speed is
asserted here; the figures come from ``python -m bench`` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testsupport import harness


def run(tmp_path: Path, module: str, *args: str) -> dict[str, object]:
    output = tmp_path / f"{module}.json"
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args, "--output", str(output)],
        cwd=harness.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(output.read_text())


def test_ingest_smoke(tmp_path: Path) -> None:
    small = ["--agents", "50", "--duration", "2", "--warmup", "1", "--channels", "10"]
    report = run(tmp_path, "ingest", *small)
    (result,) = report["results"]  # type: ignore[misc]
    assert result["agents"] == 50
    assert result["reports_per_s"] > 0
    assert result["stream_errors"] == 0
    assert 0 < result["aggregator_cpu_percent"] < 200
    assert result["aggregator_rss_mib"] > result["rss_empty_mib"] > 0
    assert 0 < report["tracked_pod_bytes"] < 100_000  # type: ignore[operator]


def test_detection_smoke(tmp_path: Path) -> None:
    report = run(tmp_path, "detection", "--flips", "4", "--agents", "4", "--kinds", "503")
    (result,) = report["results"]  # type: ignore[misc]
    assert result["flips"] >= 4
    assert 0 < result["p50_s"] <= result["p99_s"] <= result["max_s"] < 30


def test_failover_smoke(tmp_path: Path) -> None:
    report = run(tmp_path, "failover", "--kills", "1", "--pods", "4", "--steady", "0.5")
    (kill,) = report["kills"]  # type: ignore[misc]
    assert 0 < kill["serving_s"] <= kill["agents_s"] < 30
    assert report["spurious_writes"] == 0


def test_flood_smoke(tmp_path: Path) -> None:
    small = ["--sizes", "50", "--kinds", "silent,hello", "--hold", "1", "--no-reap"]
    report = run(tmp_path, "flood", *small)
    results = report["results"]
    assert [r["kind"] for r in results] == ["silent", "hello"]  # type: ignore[index]
    for result in results:  # type: ignore[attr-defined]
        assert result["opened"] == 50
        assert result["health_during"] == "SERVING"
        assert result["live_errors"] == []
        assert 0 < result["bytes_per_connection"] < 1_000_000
