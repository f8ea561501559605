"""The fallback storm benchmark cannot rot: 25 simulated agents (20 sidecars, 5 DaemonSet agents
of 2 pods), half their pods failing, lose the aggregator; the bench completes in about half a
minute, the failing pods are written once the Lease ages out, the others are not, and nothing is
written while the Lease is renewed. No speed is asserted (``python -m bench.fallback_storm``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testsupport import harness


def test_fallback_storm_smoke(tmp_path: Path) -> None:
    output = tmp_path / "fallback_storm.json"
    small = [
        *("--sidecars", "20", "--nodes", "5", "--failing", "0.5", "--budget", "40"),
        # The Lease is read (the fallback is due) while it is still renewed, then ages out:
        *("--connected", "1", "--fallback-after", "2", "--renewed-for", "4", "--duration", "20"),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "bench.fallback_storm", *small, "--output", str(output)],
        cwd=harness.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(output.read_text())
    for key in ("fleet", "connected", "lease_renewed", "after_t0", "writes", "generator", "table"):
        assert key in report, key
    fleet, writes, after = report["fleet"], report["writes"], report["after_t0"]
    assert fleet["agents"] == 25
    assert fleet["pods"] == 30
    assert fleet["failing_pods"] == 15
    assert writes["failing_pods_written"] == 15
    assert writes["healthy_pods_patched_count"] == writes["healthy_pods_not_true_count"] == 0
    assert report["connected"]["requests"] == 0
    renewed = report["lease_renewed"]
    assert renewed["writes_and_events"] == 0
    assert renewed["requests"] > 0
    assert set(renewed["by_verb"]) <= {"get leases", "watch leases"}
    assert after["pod_patches"] == 15
    assert 0 < after["max_in_any_1s"] <= after["requests"]
    for figure in ("first_write_after_t0_s", "actual_minus_model_s"):
        assert set(writes[figure]) == {"first", "median", "p95", "last"}
