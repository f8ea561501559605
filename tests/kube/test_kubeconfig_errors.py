"""A ``--kubeconfig`` that is missing or malformed stops the aggregator at start with one line
that names the file (issue 12, point 5), for the real process: no traceback, exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def start(kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator",
            "--kubeconfig",
            str(kubeconfig),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param(None, "does not exist", id="missing"),
        pytest.param("garbage: [\n", "cannot load the Kubernetes configuration", id="bad-yaml"),
        pytest.param("apiVersion: v1\nkind: Config\n", "cannot load", id="no-context"),
    ],
)
def test_a_bad_kubeconfig_is_one_line_naming_the_file(
    tmp_path: Path, content: str | None, expected: str
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    if content is not None:
        kubeconfig.write_text(content)
    done = start(kubeconfig)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr
    assert str(kubeconfig) in errors[0]
    assert expected in errors[0]
