"""Bodies captured from real systems, replayed by the tests and the benchmarks (``data/``)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
#: A Ray head's ``/api/serve/applications/`` answer, whose cluster has a HeadOnly worker.
SERVE_APPLICATIONS_HEADONLY = DATA / "serve_applications_headonly.json"
