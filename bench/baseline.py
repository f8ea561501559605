"""Ours next to theirs: detection of one failure and a full pass, as ratios.

Theirs, computed from KubeRay's settings (no cluster runs here):

- worker pods: a kubelet readiness probe, period 5 s, timeout 2 s, failure threshold 1. A
  failure is noticed at the next probe: on average half a period later, at worst a whole
  period, plus the timeout when the proxy hangs;
- the seed's design (KubeRay PR #367): the operator lists the pods and GETs each
  ``/-/healthz`` one after another with a 2 s timeout, every reconcile; the full pass is
  measured by ``bench.pull_sweep`` on a fleet of 2,000 fake proxies with 5 % hung.

Ours, from the measurements in bench/results/ (``bench.detection`` and ``bench.pull_sweep``).

    python -m bench.baseline      # after python -m bench.detection and python -m bench.pull_sweep
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testsupport import harness

RESULTS = harness.REPO_ROOT / "bench" / "results"
PERIOD, TIMEOUT = 5.0, 2.0  # KubeRay's worker readiness probe


def kuberay_detection(hang: bool) -> tuple[float, float]:
    """(mean, worst) seconds from a proxy failing to the pod being NotReady."""
    extra = TIMEOUT if hang else 0.0
    return PERIOD / 2 + extra, PERIOD + extra


def main() -> int:
    detection = json.loads((RESULTS / "detection.json").read_text())["results"]
    sweep = json.loads((RESULTS / "pull_sweep.json").read_text())
    rows = []
    for result in detection:
        hang = result["kind"] == "hang"
        mean, worst = kuberay_detection(hang)
        rows.append(
            (
                f"detect one failure ({'hung proxy' if hang else '503 / refused'})",
                f"p50 {result['p50_s']:.2f} s, p99 {result['p99_s']:.2f} s",
                f"mean {mean:.1f} s, worst {worst:.1f} s",
                f"{mean / result['p50_s']:.1f}x / {worst / result['p99_s']:.1f}x",
            )
        )
    ours_first, ours_steady = sweep["ours"]["first_median_s"], sweep["ours"]["steady_median_s"]
    seed = sweep["seed"]["full_pass_s"]
    rows.append(
        (
            "full pass, 2,000 pods, 5 % hung",
            f"{ours_first:.2f} s first, {ours_steady:.2f} s steady",
            f"{seed:.1f} s (seed, sequential)",
            f"{seed / ours_first:.0f}x / {seed / ours_steady:.0f}x",
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    header = ("", "ours", "theirs", "ratio")
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    (RESULTS / "baseline.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
