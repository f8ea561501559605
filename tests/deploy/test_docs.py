"""The operator docs in docs/ tell the truth: the configuration reference is generated from the
settings dataclasses and lists every flag of both commands, every grpcurl command in them runs
against a live aggregator, the metrics list is the metrics the aggregator has, and every path
and link they give exists."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from aggregator.flags import AggregatorFlags
from aggregator.server import Aggregator
from node_agent.flags import AgentFlags
from servehealth_common.config import ENV_PREFIX, describe
from tests import grpcurl
from tests.deploy.manifests import ROOT

DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
# The operator's docs (issue 6); other pages in docs/ have tests of their own.
OPERATOR_DOCS = [DOCS / "install.md", CONFIGURATION, DOCS / "operations.md"]
DOCUMENTED_ADDRESS = "localhost:50051"  # where `kubectl port-forward` puts the aggregator


def grpcurl_commands() -> list[str]:
    return grpcurl.documented_commands(*OPERATOR_DOCS)


def test_generated_docs_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_configuration_reference_is_generated_from_the_settings() -> None:
    """The part of the check above that is docs/configuration.md, on its own."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_docs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert CONFIGURATION.read_text() == gen_docs.configuration(), (
        "docs/configuration.md is out of date: run python scripts/gen_docs.py"
    )


@pytest.mark.parametrize(
    "row",
    [
        *[pytest.param(row, id=f"aggregator{row['flag']}") for row in describe(AggregatorFlags)],
        *[pytest.param(row, id=f"agent{row['flag']}") for row in describe(AgentFlags)],
    ],
)
def test_every_flag_is_in_the_configuration_reference(row: dict[str, str]) -> None:
    expected = f"| `{row['flag']}` | `{row['env']}` | `{row['default']}` |"
    lines = CONFIGURATION.read_text().splitlines()
    assert any(line.startswith(expected) for line in lines), f"no row starting {expected!r}"


def test_configuration_reference_states_the_environment_rule() -> None:
    text = CONFIGURATION.read_text()
    assert f"`{ENV_PREFIX}SOME_NAME`" in text
    assert "`--some-name`" in text
    for command in ("serve-health-aggregator", "serve-health-agent"):
        assert f"## `{command}`" in text


def test_docs_have_grpcurl_recipes_through_port_forward() -> None:
    commands = grpcurl_commands()
    assert len(commands) >= 5
    assert all(DOCUMENTED_ADDRESS in command for command in commands), commands
    operations = (DOCS / "operations.md").read_text()
    assert "port-forward svc/ray-serve-health-aggregator 50051:50051" in operations


async def test_every_grpcurl_command_in_the_docs_runs(aggregator: Aggregator) -> None:
    await grpcurl.run_documented(grpcurl_commands(), DOCUMENTED_ADDRESS, aggregator.port)


def defined_metrics() -> set[str]:
    """The exposition names of the metrics aggregator/metrics.py and node_agent/metrics.py (the
    agent's own, on its --metrics-listen port) define: by a constructor, or by a ``Metrics``
    helper named after its kind (``self._counter("name", ...)``)."""
    suffix = {"Counter": "_total", "counter": "_total", "Info": "_info"}
    found = set()
    for module in ("aggregator/metrics.py", "node_agent/metrics.py"):
        path = ROOT / module
        if not path.exists():
            continue
        source = path.read_text()
        prefix = re.search(r'^PREFIX = "(\w+)"', source, flags=re.MULTILINE)[1]  # type: ignore[index]
        found |= {
            f"{prefix}_{name}{suffix.get(kind or helper, '')}"
            for kind, helper, name in re.findall(
                r'\b(?:(Counter|Gauge|Histogram|Info|GaugeMetricFamily)\(\s*f"\{PREFIX\}_|'
                r'self\._(counter|gauge|histogram|scraped)\(\s*")(\w+)"',
                source,
            )
        }
    return found


def test_operations_lists_every_metric_and_no_other() -> None:
    defined = defined_metrics()
    assert len(defined) >= 15, defined
    text = (DOCS / "operations.md").read_text()
    rows = set(re.findall(r"^\| `(serve_health_\w+)(?:\{[^}]*\})?` \|", text, flags=re.MULTILINE))
    assert rows == defined, f"missing: {defined - rows}, not defined: {rows - defined}"


def test_paths_and_links_in_the_docs_exist() -> None:
    missing = []
    for path in OPERATOR_DOCS:
        text = path.read_text()
        for mentioned in re.findall(r"`((?:deploy|scripts|docs|tests)/[\w./-]*)`", text):
            if not (ROOT / mentioned).exists():
                missing.append(f"{path.name}: {mentioned}")
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not link.startswith(("http://", "https://")) and not (path.parent / link).exists():
                missing.append(f"{path.name}: link {link}")
    assert not missing, missing


def test_paths_in_manifest_comments_exist() -> None:
    missing = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        for mentioned in re.findall(
            r"(?<![\w/.-])((?:deploy|docs|tests|scripts)/[\w./-]*[\w/])", path.read_text()
        ):
            if not (ROOT / mentioned).exists():
                missing.append(f"{path.relative_to(ROOT)}: {mentioned}")
    assert not missing, missing
