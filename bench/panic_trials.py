"""Randomized trials of self-protection, many seeds: the figures behind issue 12's invariant.

Runs the discrete-event simulation of ``testsupport/simulation.py`` (the real core, both programs'
default settings, a simulated clock) over ``--seeds`` seeds of each scenario:

- mass hang at once (6-60 pods, 50-100 % of them fail at the same moment, any mix of pushed and
  agentless pods, every phase random): label writes of ``false`` (target 0);
- mass hang developing (the same, each proxy failing at a random moment within one pull
  interval): removals made before PANIC showed itself, how many were put back, pods out at the
  end (target 0), and the most pods out for a suspect failure at any moment, as a share of the
  fleet (target: below the threshold);
- lone hang: time from the hang to the label write, pushed and agentless pods apart (bounds:
  probe interval + probe timeout = 1.25 s; pull interval + pull timeout = 5.5 s).

Simulated time, so no CPU pinning matters. Writes bench/results/panic_trials.json.

    python -m bench.panic_trials [--seeds 1000]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testsupport import harness
from testsupport.simulation import DEFAULTS, lone_bound, mass_at_once, mass_developing, one_hang

OUTPUT = harness.REPO_ROOT / "bench" / "results" / "panic_trials.json"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def at_once(seeds: range) -> dict[str, Any]:
    removals = panics = 0
    for seed in seeds:
        trial = mass_at_once(seed)
        removals += len(trial.removals)
        panics += trial.sim.core.panic
    return {"seeds": len(seeds), "removals": removals, "seeds_in_panic": panics}


def developing(seeds: range) -> dict[str, Any]:
    removals = with_removals = out_at_end = 0
    worst_share = 0.0
    for seed in seeds:
        trial = mass_developing(seed)
        sim = trial.sim
        removals += len(trial.removals)
        with_removals += bool(trial.removals)
        out_at_end += len(sim.out_of_service())
        worst_share = max(worst_share, sim.out_for_suspect_max / len(sim.keys))
    return {
        "seeds": len(seeds),
        "removals_before_panic": removals,
        "seeds_with_removals": with_removals,
        "out_at_end": out_at_end,
        "max_share_out_for_suspect": round(worst_share, 3),
        "threshold": DEFAULTS.threshold,
    }


def lone(seeds: range) -> dict[str, Any]:
    times: dict[str, list[float]] = {"pushed": [], "agentless": []}
    missed = 0
    for seed in seeds:
        trial = one_hang(seed)
        (key,) = trial.failing
        kind = "pushed" if key in trial.sim.pushed else "agentless"
        if [w.key for w in trial.removals] != [key]:
            missed += 1
            continue
        elapsed = trial.removals[0].at - trial.onset
        missed += elapsed > lone_bound(trial) + 0.002
        times[kind].append(elapsed)
    result: dict[str, Any] = {"seeds": len(seeds), "missed_bound": missed}
    for kind, values in times.items():
        if values:
            result[kind] = {
                "count": len(values),
                "p50_s": round(statistics.median(values), 3),
                "p99_s": round(percentile(values, 0.99), 3),
                "max_s": round(max(values), 3),
            }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--output", type=Path, default=OUTPUT, help="JSON result file")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # thousands of PANIC lines, by design
    seeds = range(args.seeds)
    report = {"at_once": at_once(seeds), "developing": developing(seeds), "lone": lone(seeds)}
    for name, figures in report.items():
        print(f"{name:>10}: {json.dumps(figures)}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
