"""deploy/components/monitoring: a kustomize Component with a ServiceMonitor (the aggregator),
two PodMonitors (the DaemonSet agents, the sidecars), a PrometheusRule (the alerts
docs/operations.md recommends) and a Grafana dashboard ConfigMap. It renders on its own and from
an overlay's ``components:``, its objects validate offline (the Prometheus Operator's CRD
schemas vendored in tests/deploy/crds/), the ServiceMonitor finds the aggregator's metrics port
and the PodMonitors the agents', the dashboard is valid JSON with a query in every panel, and
every metric a query names is one a real aggregator or agent exports on /metrics.

The alerts, without promtool (issue 28, point 8): every expression parses (promql-parser, the
Prometheus parser's Rust port), every metric one names is defined in aggregator/metrics.py or
node_agent/metrics.py and exported by the real program, every ``for`` is at least the scrape
interval of the metrics it reads, every alert has a ``runbook_url`` whose anchor is a heading of
docs/operations.md, and there are alerts for an aggregator gone (``absent(up{job=...})``, the job
the ServiceMonitor gives it), agents in fallback, denied writes and failed authentication."""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from tests.deploy import crd_schemas
from tests.deploy.manifests import DEPLOY, ROOT, find, pod_specs, render, render_written
from tests.deploy.test_docs import defined_metrics
from tests.deploy.test_probes import command, started, stop

COMPONENT = "deploy/components/monitoring"
DASHBOARD = DEPLOY / "components" / "monitoring" / "dashboard.json"
OVERLAYS = ["deploy/overlays/label-mode", "deploy/overlays/readiness-gate-mode"]
NAMESPACE = "ray-serve-health"
AGGREGATOR = "ray-serve-health-aggregator"
METRICS_SERVICE = "ray-serve-health-aggregator-metrics"
OPERATIONS = ROOT / "docs" / "operations.md"
# Grafana's own interval variables, which are not PromQL, and what stands for them in a parse.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(\w+)\}")


# -- rendering --------------------------------------------------------------------------


def test_component_is_a_component() -> None:
    document = yaml.safe_load((ROOT / COMPONENT / "kustomization.yaml").read_text())
    assert document["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert document["kind"] == "Component"


def test_component_renders_on_its_own() -> None:
    objects = render(COMPONENT)
    assert sorted(obj["kind"] for obj in objects) == [
        "ConfigMap",
        "PodMonitor",
        "PodMonitor",
        "PrometheusRule",
        "ServiceMonitor",
    ]
    configmap = find(objects, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    # No hash suffix: `kubectl apply` changes the one ConfigMap the sidecar loads.
    assert configmap["metadata"]["name"] == "ray-serve-health-dashboard"
    (content,) = configmap["data"].values()
    assert json.loads(content) == json.loads(DASHBOARD.read_text())


def render_in_overlay(overlay: str, tmp_path: Path) -> list[dict[str, Any]]:
    """What a user's overlay renders that adds the component to ``overlay``."""
    here = tmp_path / "overlay"
    here.mkdir()
    (here / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": NAMESPACE,
                "resources": [os.path.relpath(ROOT / overlay, here)],
                "components": [os.path.relpath(ROOT / COMPONENT, here)],
            }
        )
    )
    return render_written(here)


@pytest.mark.parametrize("overlay", [*OVERLAYS, "example"])
def test_servicemonitor_scrapes_the_aggregators_metrics_port(overlay: str, tmp_path: Path) -> None:
    if overlay == "example":
        objects = render("deploy/examples/monitoring")
    else:
        objects = render_in_overlay(overlay, tmp_path)
    monitor = find(objects, "ServiceMonitor")
    find(objects, "PrometheusRule")
    find(objects, "ConfigMap", "ray-serve-health-dashboard")
    deployment = find(objects, "Deployment", AGGREGATOR)
    # Selected in the ServiceMonitor's own namespace (no namespaceSelector), by the labels: the
    # metrics Service alone, which selects every replica (not the leader-only Service).
    assert "namespaceSelector" not in monitor["spec"]
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    (service,) = [
        o
        for o in objects
        if o["kind"] == "Service" and wanted <= o["metadata"].get("labels", {}).items()
    ]
    assert service["metadata"]["name"] == METRICS_SERVICE
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    for obj in (monitor, find(objects, "PrometheusRule"), service):
        assert obj["metadata"]["namespace"] == NAMESPACE, obj["kind"]
    (endpoint,) = monitor["spec"]["endpoints"]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    target = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    listen = next(
        e["value"] for e in container["env"] if e["name"] == "SERVE_HEALTH_METRICS_LISTEN"
    )
    assert listen.endswith(f":{target['containerPort']}")
    assert endpoint.get("path", "/metrics") == "/metrics"


# -- offline validation -----------------------------------------------------------------


def test_component_objects_validate_against_the_crds() -> None:
    found = [
        f"{obj['kind']}: {problem}"
        for obj in render(COMPONENT)
        if obj["apiVersion"].split("/")[0] in crd_schemas.groups()
        for problem in crd_schemas.problems(obj)
    ]
    assert not found, "\n".join(found)


def test_crd_validation_is_not_vacuous() -> None:
    """A misspelt field, a wrong type and a missing required field are caught."""
    monitor = find(render(COMPONENT), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert crd_schemas.problems(monitor)
    rule = find(render(COMPONENT), "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["expr"] = ["not", "a", "string"]
    assert crd_schemas.problems(rule)
    rule = find(render(COMPONENT), "PrometheusRule")
    del rule["spec"]["groups"][0]["name"]
    assert crd_schemas.problems(rule)
    rule["apiVersion"] = "monitoring.coreos.com/v2"
    assert crd_schemas.problems(rule)


# -- the dashboard ----------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed panels included (rows themselves are not panels)."""
    for item in items:
        if item.get("type") == "row":
            yield from panels(item.get("panels", []))
        else:
            yield item


def test_dashboard_is_valid_and_every_panel_has_a_query() -> None:
    board = dashboard()
    assert board["uid"]
    assert board["title"]
    assert isinstance(board["schemaVersion"], int)
    found = list(panels(board["panels"]))
    assert len(found) >= 10
    ids = [item["id"] for item in board["panels"]] + [
        item["id"] for row in board["panels"] for item in row.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {variable["name"] for variable in board["templating"]["list"]}
    for panel in found:
        title = panel.get("title")
        assert title, panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], f"{title}: no query"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{title}: a target without expr"
            for used in re.findall(r"\$(\w+)", target["expr"]):
                assert used in variables or used.startswith("__"), f"{title}: ${used}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, title


def test_dashboard_covers_what_the_issue_asks() -> None:
    queries = " ".join(
        target["expr"] for panel in panels(dashboard()["panels"]) for target in panel["targets"]
    )
    for metric in (
        "serve_health_pods",
        "serve_health_transitions_total",
        "serve_health_pull_probe_seconds_bucket",  # probe latency: the aggregator's own
        "serve_health_report_probe_seconds_bucket",  # and the agents'
        "serve_health_write_delay_seconds_bucket",  # detection: the aggregator's share
        "serve_health_label_writes_total",
        "serve_health_api_retries_total",
        "serve_health_panic",
        "serve_health_agents_connected",
        "serve_health_pods_in_pull_mode",
        "serve_health_shadow_disagreements",
        "serve_health_would_be_writes_total",
        "serve_health_overrides",
    ):
        assert re.search(rf"\b{metric}\b", queries), metric


# -- the alerts -------------------------------------------------------------------------


def rules() -> list[dict[str, Any]]:
    rule = find(render(COMPONENT), "PrometheusRule")
    return [item for group in rule["spec"]["groups"] for item in group["rules"]]


def normal(expression: str) -> str:
    return re.sub(r"\s+", " ", expression).strip()


def documented_alerts() -> list[str]:
    """The expressions docs/operations.md recommends to alert on."""
    text = OPERATIONS.read_text()
    paragraph = re.search(
        r"^Alerts worth having:(.*?)(?:\n\n)", text, flags=re.MULTILINE | re.DOTALL
    )
    assert paragraph, "docs/operations.md: no 'Alerts worth having:' paragraph"
    found = re.findall(r"`([^`]*serve_health_[^`]*)`", paragraph[1])
    # And the leader-election one, where the section on the standby names it as an alert.
    found += re.findall(r"alert on\s*`(sum\(serve_health_leader\)[^`]*)`", text)
    return found


def test_every_documented_alert_is_a_rule() -> None:
    documented = documented_alerts()
    assert len(documented) >= 4, documented
    expressions = [normal(rule["expr"]) for rule in rules()]
    # Exactly one leader among the replicas (docs/operations.md, "High availability").
    assert any("sum(serve_health_leader) != 1" in e for e in expressions), expressions
    for expression in documented:
        assert any(normal(expression) in e for e in expressions), f"no rule for `{expression}`"
    by_name = {rule["alert"]: rule for rule in rules()}
    # "serve_health_pods_in_pull_mode > 0 for 10 minutes"
    assert by_name["ServeHealthPodsInPullMode"]["for"] == "10m"
    for rule in rules():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


# -- every metric named exists ----------------------------------------------------------


def aggregator_command() -> list[str]:
    beside = shutil.which("serve-health-aggregator", path=str(Path(sys.executable).parent))
    return [beside] if beside else [sys.executable, "-m", "aggregator"]


@pytest.fixture(scope="module")
def exported() -> Iterator[set[str]]:
    """The metric names on a real aggregator's /metrics (memory backend, loopback)."""
    process = subprocess.Popen(
        [
            *aggregator_command(),
            "--kube-backend=memory",
            "--auth=none",
            "--listen=127.0.0.1:0",
            "--metrics-listen=127.0.0.1:0",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        address = metrics_address(process)
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            text = response.read().decode()
        yield names_in(text)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def metrics_address(process: subprocess.Popen[bytes], timeout: float = 30.0) -> str:
    """HOST:PORT of /metrics, from the aggregator's "listening on ... metrics HOST:PORT" line."""
    assert process.stderr is not None
    seen = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and selector.select(left):
            chunk = os.read(process.stderr.fileno(), 65536)
            if not chunk:
                break  # the process ended
            seen += chunk
            match = re.search(rb"listening on .*\bmetrics (\S+?:\d+)\)", seen)
            if match:
                return match[1].decode()
    pytest.fail(f"the aggregator did not say where /metrics listens:\n{seen.decode()}")


def names_in(text: str) -> set[str]:
    """Series names in a Prometheus text exposition: every sample's, and every declared
    family's (a labelled family has no sample until its first observation); a histogram's
    ``_bucket``, ``_sum`` and ``_count``."""
    names = set(re.findall(r"^([A-Za-z_:][\w:]*)(?:\{| )", text, flags=re.MULTILINE))
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, flags=re.MULTILINE):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects, from its parse tree (Grafana's interval
    variables read as 5m; other variables sit in label values, where any string parses)."""
    parsed = promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expression))
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                found.add(node.name)
            found.update(m.value for m in node.matchers.matchers if m.name == "__name__")

    promql_parser.walk(parsed, visit)
    return found


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard and every rule's expression."""
    found = [
        (f"panel {panel['title']!r} {target['refId']}", target["expr"])
        for panel in panels(dashboard()["panels"])
        for target in panel["targets"]
    ]
    found += [(f"alert {rule['alert']}", rule["expr"]) for rule in rules()]
    return found


def test_metric_names_come_from_the_parse_tree() -> None:
    """Not from the text: label names, label values, functions and grouping are no metrics."""
    assert metric_names(
        "histogram_quantile(0.9, sum by (le) "
        '(rate(a_bucket{job=~"$job",x="b_total"}[$__rate_interval])))'
        ' / on (instance) group_left {__name__="c"} and d offset 1h'
    ) == {"a_bucket", "c", "d"}
    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        promql_parser.parse("sum(rate(a[5m])")


@pytest.fixture(scope="module")
def agent_exported() -> Iterator[set[str]]:
    """The metric names on a real agent's /metrics (a sidecar with nothing to probe: the same
    families as a DaemonSet agent's, node_agent/metrics.py)."""
    process, address = started(
        [
            *command("serve-health-agent", "node_agent"),
            "--mode=sidecar",
            "--aggregator=127.0.0.1:9",
            "--proxy-url=http://127.0.0.1:9/-/healthz",
            "--token-file=",
            "--metrics-listen=127.0.0.1:0",
        ],
        rb"serving /livez, /readyz and /metrics on (\S+?:\d+)",
        {
            "POD_NAME": "worker-1",
            "POD_NAMESPACE": "ray",
            "POD_UID": "7f1c0e52-0000-4000-8000-000000000001",
            "NODE_NAME": "node-a",
        },
    )
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            yield names_in(response.read().decode())
    finally:
        stop(process)


def test_every_metric_in_a_query_is_exported(exported: set[str], agent_exported: set[str]) -> None:
    assert "serve_health_pods" in exported, sorted(exported)
    assert "serve_health_agent_fallback_seconds" in agent_exported, sorted(agent_exported)
    # Prometheus's own: a scrape's up.
    exported = exported | agent_exported | {"up"}
    used: dict[str, list[str]] = {}
    for where, expression in queries():
        names = metric_names(expression)
        assert names, f"{where}: selects no metric: {expression}"
        for name in names:
            used.setdefault(name, []).append(where)
    # The job variable's values come from a metric too.
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if isinstance(query, str) and query.startswith("label_values("):
            (name,) = re.findall(r"label_values\((\w+)", query)
            used.setdefault(name, []).append(f"variable {variable['name']}")
    missing = {name: where for name, where in used.items() if name not in exported}
    assert not missing, f"not on the aggregator's nor an agent's /metrics: {missing}"


# -- the alerts, checked without promtool (issue 28, point 8) ------------------------------

DOCKERFILE = ROOT / "Dockerfile"
AGENT = "ray-serve-health-agent"
#: Prometheus's own series, which no program of ours defines.
PROMETHEUS_OWN = {"up"}
DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")
SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(text: str) -> float:
    parts = DURATION.findall(text)
    assert parts, f"not a duration: {text}"
    assert "".join(f"{n}{u}" for n, u in parts) == text, f"not a duration: {text}"
    return sum(int(n) * SECONDS[u] for n, u in parts)


def agent_metrics() -> set[str]:
    return {name for name in defined_metrics() if name.startswith("serve_health_agent_")}


def series_names(expression: str) -> set[str]:
    """The series an expression selects, a histogram's _bucket/_sum/_count read as its own."""
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in metric_names(expression)}


def monitors() -> list[dict[str, Any]]:
    return [o for o in render(COMPONENT) if o["kind"] in {"ServiceMonitor", "PodMonitor"}]


def endpoints(monitor: dict[str, Any]) -> list[dict[str, Any]]:
    return monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]


def interval_of(kind: str) -> float:
    """The longest scrape interval of the monitors of ``kind`` (Prometheus's default, 30 s in
    the operator's, where an endpoint sets none)."""
    found = [
        seconds(e.get("interval", "30s"))
        for m in monitors()
        if m["kind"] == kind
        for e in endpoints(m)
    ]
    assert found, kind
    return max(found)


def scrape_interval(expression: str) -> float:
    """The interval at which the series an alert reads are scraped: the agents' by the
    PodMonitors, the aggregator's (and its up) by the ServiceMonitor."""
    names = series_names(expression)
    kinds = {"PodMonitor" if name in agent_metrics() else "ServiceMonitor" for name in names}
    return max(interval_of(kind) for kind in kinds)


def test_every_alert_expression_parses() -> None:
    for rule in rules():
        try:
            promql_parser.parse(rule["expr"])
        except ValueError as error:
            pytest.fail(f"{rule['alert']}: {error}")


def test_the_parse_check_is_not_vacuous() -> None:
    for broken in ('absent(up{job="a"} == 1', "rate(x[5m]) >", "sum by (a (x)"):
        with pytest.raises(ValueError, match=r"\w"):
            promql_parser.parse(broken)


def test_every_metric_an_alert_uses_is_defined_in_the_code() -> None:
    defined = defined_metrics() | PROMETHEUS_OWN
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, f"{rule['alert']}: selects no metric"
        missing = names - defined
        assert not missing, f"{rule['alert']}: {sorted(missing)} defined nowhere"


def test_every_for_is_at_least_a_scrape_interval() -> None:
    """An alert whose ``for`` is shorter than a scrape fires on one sample (a missing ``for``
    is 0)."""
    for rule in rules():
        wait = seconds(rule.get("for", "0s")) if rule.get("for") else 0.0
        assert wait >= scrape_interval(rule["expr"]), (rule["alert"], rule.get("for"))


def operations_anchors() -> set[str]:
    """The anchors GitHub gives docs/operations.md's headings."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", OPERATIONS.read_text(), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def repository() -> str:
    """The repository's address, as the image's source label gives it."""
    found = re.search(r'org\.opencontainers\.image\.source="([^"]+)"', DOCKERFILE.read_text())
    assert found
    return found[1]


def test_every_alert_has_a_runbook_in_docs_operations() -> None:
    prefix = f"{repository()}/blob/main/docs/operations.md#"
    anchors = operations_anchors()
    assert "when-every-aggregator-is-down" in anchors  # the slugs are GitHub's
    used = []
    for rule in rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(prefix), f"{rule['alert']}: runbook_url {url!r}"
        anchor = url[len(prefix) :]
        assert anchor in anchors, f"{rule['alert']}: docs/operations.md has no #{anchor}"
        used.append(anchor)
    assert len(set(used)) == len(used), "two alerts share a runbook section"


def test_an_alert_fires_when_the_aggregator_is_gone() -> None:
    """``sum(serve_health_leader) != 1`` says nothing when no replica is scraped at all (a sum
    of nothing is no sample): an ``absent()`` of the scrape's ``up`` does, with the job the
    ServiceMonitor gives the aggregator's targets (its Service's name)."""
    objects = render_in_overlay_once()
    monitor = find(objects, "ServiceMonitor")
    assert "jobLabel" not in monitor["spec"]  # the job is then the Service's name
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    (service,) = [
        o
        for o in objects
        if o["kind"] == "Service" and wanted <= o["metadata"].get("labels", {}).items()
    ]
    job = service["metadata"]["name"]
    gone = [
        rule
        for rule in rules()
        if re.search(rf'absent\(\s*up\{{job="{re.escape(job)}"\}}\s*==\s*1\s*\)', rule["expr"])
    ]
    assert gone, f"no absent(up{{job={job!r}}} == 1) alert"
    assert gone[0]["labels"]["severity"] == "critical"


def render_in_overlay_once() -> list[dict[str, Any]]:
    return render("deploy/examples/monitoring")


def alerts_on(metric: str) -> list[dict[str, Any]]:
    return [rule for rule in rules() if metric in metric_names(rule["expr"])]


def test_alerts_on_fallback_denied_writes_and_failed_auth() -> None:
    (fallback,) = alerts_on("serve_health_agent_fallback_seconds")
    assert re.search(r"serve_health_agent_fallback_seconds\s*>\s*0", fallback["expr"])
    (agent_writes,) = alerts_on("serve_health_agent_fallback_writes_total")
    assert 'result="error"' in agent_writes["expr"]
    (writes,) = alerts_on("serve_health_label_writes_total")
    assert 'result="error"' in writes["expr"]
    (denied,) = alerts_on("serve_health_api_denied_total")
    # Failed authentication: the aggregator counts every refused token check in
    # serve_health_auth_total (serve_health_streams_rejected_total counts bad input only).
    (auth,) = alerts_on("serve_health_auth_total")
    assert re.search(r'result=~"unauthenticated\|permission_denied"', auth["expr"]), auth["expr"]
    for rule in (fallback, agent_writes, writes, denied, auth):
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_podmonitor_scrapes_the_daemonset_agents(overlay: str, tmp_path: Path) -> None:
    objects = render_in_overlay(overlay, tmp_path)
    daemonset = find(objects, "DaemonSet", AGENT)
    monitor = find(objects, "PodMonitor", AGENT)
    assert "namespaceSelector" not in monitor["spec"]  # the agents' (its own) namespace
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    port = next(p for p in container["ports"] if p["name"] == endpoint["port"])
    listen = next(
        e["value"] for e in container["env"] if e["name"] == "SERVE_HEALTH_METRICS_LISTEN"
    )
    assert listen.endswith(f":{port['containerPort']}")
    assert endpoint.get("path", "/metrics") == "/metrics"


def test_a_podmonitor_scrapes_the_sidecars() -> None:
    monitor = find(render(COMPONENT), "PodMonitor", "ray-serve-health-sidecar")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}  # the Ray namespaces
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    service = find(render("deploy/examples/rayservice-sidecar"), "RayService")
    selector = monitor["spec"]["selector"]
    for where, spec in pod_specs(service):
        (sidecar,) = [c for c in spec["containers"] if c["name"] == "serve-health-agent"]
        port = next(p for p in sidecar["ports"] if p["name"] == endpoint["port"])
        listen = next(
            e["value"] for e in sidecar["env"] if e["name"] == "SERVE_HEALTH_METRICS_LISTEN"
        )
        assert listen.endswith(f":{port['containerPort']}"), where
        # Ray pods carry ray.io/node-type (KubeRay's label); the selector asks for nothing else.
        for expression in selector.get("matchExpressions", []):
            assert expression == {"key": "ray.io/node-type", "operator": "Exists"}
        assert not selector.get("matchLabels")
