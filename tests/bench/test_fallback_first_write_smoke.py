"""bench/fallback_first_write.py cannot rot: one trial of variant a (no Lease) with 3 real
sidecars and a real aggregator on the emulator completes (about 15 s) and reports sane
numbers. No speed is asserted beyond "after --fallback-after, within a generous bound"; the
figures come from ``python -m bench.fallback_first_write`` (12 sidecars, 5 trials)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testsupport import harness


def test_fallback_first_write_smoke(tmp_path: Path) -> None:
    output = tmp_path / "fallback_first_write.json"
    small = ["--pods", "3", "--trials", "1", "--variants", "a", "--hold", "1", "--settle", "0.5"]
    result = subprocess.run(
        [sys.executable, "-m", "bench.fallback_first_write", *small, "--output", str(output)],
        cwd=harness.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(output.read_text())
    (trial,) = report["trials"]
    assert trial["variant"] == "a"
    # Not before --fallback-after (3 s): the write is the agent's fallback, not the aggregator's.
    assert 3.0 <= trial["first_write_s"] <= trial["condition_false_s"] < 30
    assert trial["failing_patches"] >= 1
    assert trial["aggregator_writes_after_kill"] == 0
    # The two healthy sidecars sent nothing and loaded no Kubernetes client; the check sees the
    # failing one's.
    assert trial["healthy_requests"] == 0
    assert trial["healthy_client_loaded"] == []
    assert trial["failing_client_loaded"] is True
    assert report["variants"]["a"]["first_write_s"]["median"] == trial["first_write_s"]
