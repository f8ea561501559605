"""Python heap per tracked pod in the aggregator's own state, by tracemalloc.

Run as a script by :mod:`bench.ingest`, with ``PYTHONPATH`` naming the checkout whose
aggregator is measured (it imports nothing from ``bench``)::

    PYTHONPATH=ROOT:ROOT/proto python bench/ingest_tracked.py 10000 [on-change|heartbeat]

Prints one number: bytes per pod (tracker record, registry entry, keys, last observation),
what grows with the fleet apart from each agent's connection and stream. With ``on-change``
(an aggregator whose ``Core.hello`` knows ``reports_on_change``), each pod's stream is one that
reports on change.
"""

from __future__ import annotations

import inspect
import sys
import time
import tracemalloc

from aggregator.decision.core import Core, CoreSettings
from aggregator.decision.tracker import Observation, Tracker, TrackerSettings
from aggregator.metrics import Metrics
from aggregator.pull.puller import Puller, PullSettings
from aggregator.registry import MemoryRegistry
from servehealth_common.pod_identity import PodInfo, PodKey
from servehealth_common.states import ServeState

NAMESPACE = "bench"
LABEL = "ray.io/serve"


def tracked_pod_bytes(count: int, on_change: bool) -> float:
    on_change = on_change and "reports_on_change" in inspect.signature(Core.hello).parameters
    core = Core(
        Tracker(TrackerSettings(), time.monotonic),
        MemoryRegistry(LABEL),
        Metrics("b"),
        Puller(PullSettings(5.0, 0.5, 256, 3.0), Metrics("p")),  # not started: pulls nothing
        CoreSettings(),
    )
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(count):
        key = PodKey(NAMESPACE, f"raycluster-worker-{i:05d}")
        pods = [PodInfo(key, uid=f"{i:08d}-0000-0000-0000-000000000000")]
        stream = core.hello(pods, reports_on_change=True) if on_change else core.hello(pods)
        core.report(stream, key, Observation(ServeState.SERVING, "success", 200, 0.002))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return grown / count


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    print(round(tracked_pod_bytes(count, sys.argv[2:3] == ["on-change"])))
