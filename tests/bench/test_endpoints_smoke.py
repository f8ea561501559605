"""bench/endpoints.py cannot rot: both probe variants on 4 workers, with a real aggregator and a
real DaemonSet agent on the emulator, the kubelet's schedule at a fifth of real time (about 45
s): one lone 503, one 75 % hang of 3 s, the HeadOnly worker in condition mode and (documented
probe) in ``--mode both``. The assertions are what cannot depend on timing: who takes a pod
out, the kubelet's proxy check removing every hung pod, PANIC's floor (half the pods), the
HeadOnly worker's conditions. The figures come from ``python -m bench.endpoints`` (real time,
12 workers, 8 trials)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testsupport import harness


def test_endpoints_smoke(tmp_path: Path) -> None:
    output = tmp_path / "endpoints.json"
    small = [
        *("--pods", "4", "--trials", "1", "--mass-trials", "1", "--mass-window", "3"),
        *("--observe", "2", "--headonly-observe", "1", "--kubelet-time-scale", "0.2"),
        *("--scenarios", "503,mass,headonly", "--headonly-modes", "both"),
        *("--headonly-variants", "documented"),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "bench.endpoints", *small, "--output", str(output)],
        cwd=harness.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(output.read_text())
    results = report["results"]
    assert set(results) == {"injected", "documented"}
    assert results["injected"]["pods_kubelet_checks_serve"] == 5  # and the HeadOnly worker
    assert results["documented"]["pods_kubelet_checks_serve"] == 0

    # A lone 503: out of the endpoints either way; with the documented probe, by our condition.
    for variant in ("injected", "documented"):
        lone = results[variant]["lone"]["503"]
        assert lone["left_endpoints"] == lone["trials"] == 1
        assert 0 < lone["out_s"]["max"] < 20
    assert results["documented"]["lone"]["503"]["decided_by"] == {"aggregator": 1}

    # 75 % hang (3 of 4): the kubelet's proxy check takes out every hung pod; our probe leaves
    # it to PANIC, which never lets the failures reach half the pods.
    injected, documented = results["injected"]["mass"], results["documented"]["mass"]
    assert injected["hung"] == documented["hung"] == 3
    assert injected["kept_end_min"] == 1
    assert documented["kept_min"] >= 2

    # The HeadOnly worker: our condition True; Ready only without the kubelet's proxy check; in
    # --mode both, Ready and not an endpoint.
    for variant in ("injected", "documented"):
        headonly = results[variant]["headonly"]["condition"]
        assert headonly["aggregator_state"] == "SERVE_STATE_NO_PROXY_BY_DESIGN"
        assert headonly["gate"] == {"status": "True", "reason": "NoProxyByDesign"}
    assert results["injected"]["headonly"]["condition"]["ready"] == "False"
    assert results["documented"]["headonly"]["condition"]["ready"] == "True"
    both = results["documented"]["headonly"]["both"]
    assert (both["ready"], both["label"], both["endpoint"]) == ("True", "false", False)
    assert set(results["injected"]["headonly"]) == {"condition"}
    assert "load average" in report["uptime_before"]
