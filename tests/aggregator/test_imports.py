"""What the aggregator process loads: not aiohttp (/metrics is served on h11 by
servehealth_common/metrics_http.py; aiohttp is a test dependency only).

Checked in a fresh interpreter, since this test process has aiohttp loaded for its servers, and
with a real aggregator running (memory backend) so that every module it uses at run time is in.
"""

from __future__ import annotations

import subprocess
import sys

#: aiohttp and what only it brings in.
HEAVY = ("aiohttp", "yarl", "multidict")

RUN_AGGREGATOR = """
import asyncio, sys
from aggregator.flags import AggregatorFlags
from aggregator.wiring import build_aggregator

async def main():
    aggregator = build_aggregator(AggregatorFlags(
        listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", kube_backend="memory", auth="none"
    ))
    await aggregator.start()
    await aggregator.stop()

asyncio.run(main())
import aggregator.cli
print(",".join(sorted(name for name in {heavy!r} if name in sys.modules)))
"""


def test_the_aggregator_does_not_import_aiohttp() -> None:
    done = subprocess.run(
        [sys.executable, "-c", RUN_AGGREGATOR.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = done.stdout.strip().splitlines()[-1:]
    assert loaded in ([], [""]), f"the aggregator imports {loaded}"
