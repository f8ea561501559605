"""Issue 28, point 10: the overlays' defaults are TLS off and ``--inspection-auth none`` (checked
here on the rendered overlays, so that the text cannot outlive them); docs/install.md leads with
the production example, which turns TLS and the NetworkPolicies on, and says what each default
exposes: which port answers whom with what."""

from __future__ import annotations

import re

import pytest

from aggregator.flags import AggregatorFlags
from servehealth_common.config import load
from tests.deploy.manifests import ROOT, environment, find, render

INSTALL = (ROOT / "docs" / "install.md").read_text()
PRODUCTION = "deploy/examples/production"
OVERLAYS = [
    "deploy/overlays/label-mode",
    "deploy/overlays/readiness-gate-mode",
    "deploy/overlays/shadow-mode",
    "deploy/overlays/namespaced",
]
AGGREGATOR = "ray-serve-health-aggregator"


def aggregator_settings(directory: str) -> tuple[AggregatorFlags, dict[str, str]]:
    objects = render(directory)
    container = find(objects, "Deployment", AGGREGATOR)["spec"]["template"]["spec"]["containers"][0]
    environ = environment(container, objects)
    loadable = {k: v for k, v in environ.items() if not k.startswith("SERVE_HEALTH_TLS_")}
    flags = load(AggregatorFlags, [], loadable, "serve-health-aggregator", "")
    return flags, environ


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", INSTALL, re.M | re.S)
    assert match, f"docs/install.md has no section {title!r}"
    return match[1]


@pytest.mark.parametrize("directory", OVERLAYS)
def test_the_overlays_defaults_are_what_the_docs_call_them(directory: str) -> None:
    flags, environ = aggregator_settings(directory)
    assert "SERVE_HEALTH_TLS_CERT" not in environ  # plaintext gRPC
    assert flags.inspection_auth == "none"
    assert flags.auth == "tokenreview"  # reports always need a token
    assert not [o for o in render(directory) if o["kind"] == "NetworkPolicy"]


def test_the_production_example_turns_tls_and_network_policies_on() -> None:
    _, environ = aggregator_settings(PRODUCTION)
    assert environ.get("SERVE_HEALTH_TLS_CERT")
    kinds = {o["kind"] for o in render(PRODUCTION)}
    assert {"NetworkPolicy", "Certificate"} <= kinds


def test_install_leads_with_the_production_example() -> None:
    step3 = section("Step 3: your overlay, with your image")
    (first,) = re.findall(r"```yaml\n(# my-overlay/kustomization\.yaml.*?)```", step3, re.S)[:1]
    assert f"../ray-serve-health/{PRODUCTION}" in first, first
    # The first overlay the page tells you to build on is the production example.
    earliest = re.search(r"deploy/(?:examples|overlays)/[\w-]+", INSTALL.split("## Step 3", 1)[1])
    assert earliest
    assert earliest[0] == PRODUCTION


def test_install_says_what_each_default_exposes() -> None:
    text = section("What the defaults expose")
    for default in ("plaintext", "`--inspection-auth none`", "NetworkPolicy"):
        assert default in text, default
    for port in ("50051", "9090", "9091"):
        assert port in text, port
    for method in ("ListPods", "GetPod", "GetSummary", "WatchTransitions"):
        assert method in text, method
    assert "`SERVE_HEALTH_INSPECTION_AUTH=tokenreview`" in text  # how to close it
    assert PRODUCTION in text
