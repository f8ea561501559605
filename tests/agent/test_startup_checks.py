"""What the agent refuses at start, before it opens any stream (issue 13, hostile input):

- an identity the aggregator could never accept (``POD_NAME=p-sigINT``): the namespace must be
  an RFC 1123 label and the pod name an RFC 1123 subdomain, by the aggregator's own rules
  (``aggregator/ingest/wire.py``); the process exits 2 with one line instead of being refused by the
  aggregator every 2 s for ever;
- an ``--aggregator`` address that is not HOST:PORT with a port 1-65535, in any place of a
  comma-separated list;
- a ``--proxy-url`` that is not a whole http(s) URL with a host and a port 1-65535 (it used to
  be accepted and probed as UNHEALTHY for ever).

Each as ``AgentFlags`` / ``SidecarPod`` and as the real ``python -m node_agent`` process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aggregator.ingest import wire
from node_agent.flags import AgentFlags
from node_agent.identity import REQUIRED, InvalidIdentity, SidecarPod
from servehealth.v1 import servehealth_pb2 as pb

IDENTITY_ENV = {
    "POD_NAMESPACE": "ns",
    "POD_NAME": "pod-a",
    "POD_UID": "uid-1",
    "NODE_NAME": "node-1",
}


def run_agent(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    """``python -m node_agent`` with the sidecar identity (overridden by ``environ``); it must
    exit on its own, within 20 s."""
    clean = {
        key: value
        for key, value in os.environ.items()
        if key not in REQUIRED and not key.startswith("SERVE_HEALTH_")
    }
    return subprocess.run(
        [sys.executable, "-m", "node_agent", "--token-file", "", *args],
        env={**clean, **IDENTITY_ENV, **environ},
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


# -- the identity ---------------------------------------------------------------------------

NAMES = [
    "pod-a",
    "a",
    "rayservice-sample-raycluster-abc12-worker-small-group-x7k2p",
    "a.b.c",
    "0pod",
    "p-sigINT",
    "Pod-a",
    "-pod",
    "pod-",
    "pod_a",
    "pod a",
    "pod..a",
    ".pod",
    "a" * 63,
    "a" * 64,
    ".".join(["a" * 63] * 4)[:253],
    "a" * 254,
    "pöd",
]


@pytest.mark.parametrize("name", NAMES)
def test_the_agent_checks_pod_names_as_the_aggregator_does(name: str) -> None:
    hello = pb.Hello(
        mode=pb.AGENT_MODE_SIDECAR, pod=pb.PodRef(namespace="ns", name=name), node_name="n"
    )
    try:
        wire.pods_from_hello(hello)
        aggregator_accepts = True
    except wire.InvalidMessage:
        aggregator_accepts = False
    environ = {**IDENTITY_ENV, "POD_NAME": name}
    if aggregator_accepts:
        assert SidecarPod.from_environ(environ).name == name
    else:
        with pytest.raises(InvalidIdentity, match="POD_NAME"):
            SidecarPod.from_environ(environ)


@pytest.mark.parametrize("namespace", ["ns", "ray-system", "a" * 63, "a" * 64, "a.b", "NS", "-ns"])
def test_the_agent_checks_namespaces_as_the_aggregator_does(namespace: str) -> None:
    hello = pb.Hello(
        mode=pb.AGENT_MODE_SIDECAR, pod=pb.PodRef(namespace=namespace, name="p"), node_name="n"
    )
    try:
        wire.pods_from_hello(hello)
        aggregator_accepts = True
    except wire.InvalidMessage:
        aggregator_accepts = False
    environ = {**IDENTITY_ENV, "POD_NAMESPACE": namespace}
    if aggregator_accepts:
        assert SidecarPod.from_environ(environ).namespace == namespace
    else:
        with pytest.raises(InvalidIdentity, match="POD_NAMESPACE"):
            SidecarPod.from_environ(environ)


def test_a_trailing_newline_is_no_part_of_a_valid_name() -> None:
    with pytest.raises(InvalidIdentity, match="POD_NAME"):
        SidecarPod.from_environ({**IDENTITY_ENV, "POD_NAME": "pod-a\n"})


def test_an_invalid_pod_name_exits_2_with_one_line() -> None:
    completed = run_agent("--aggregator", "127.0.0.1:1", POD_NAME="p-sigINT")
    assert completed.returncode == 2, completed.stderr
    (line,) = completed.stderr.splitlines()
    assert line.startswith("serve-health-agent: error: POD_NAME 'p-sigINT' is not a valid pod name")


def test_an_invalid_namespace_exits_2_with_one_line() -> None:
    completed = run_agent("--aggregator", "127.0.0.1:1", POD_NAMESPACE="Default")
    assert completed.returncode == 2, completed.stderr
    (line,) = completed.stderr.splitlines()
    assert "POD_NAMESPACE 'Default' is not a valid namespace" in line


# -- --aggregator ---------------------------------------------------------------------------

GOOD_ADDRESSES = [
    "agg:50051",
    "127.0.0.1:1",
    "127.0.0.1:65535",
    "[::1]:50051",
    "ray-serve-health-aggregator.ray-serve-health.svc:50051",
    "svc.cluster.local.:50051",
    "a:1, b:2",
]
BAD_ADDRESSES = [
    "garbage",
    "garbage:",
    ":50051",
    "agg:0",
    "agg:65536",
    "agg:99999",
    "agg:-1",
    "agg:http",
    "agg:5e4",
    "agg:\uff15\uff10\uff10\uff15\uff11",  # full-width digits: str.isdigit() says yes
    "::1:50051",  # IPv6 without brackets
    "[::1]",
    "[not-ipv6]:50051",
    "dns:///agg:50051",
    "agg agg:50051",
    "agg:1,garbage",
    "garbage,agg:1",
    "http://agg:50051",
]


@pytest.mark.parametrize("address", GOOD_ADDRESSES)
def test_good_aggregator_addresses(address: str) -> None:
    AgentFlags(aggregator=address)


@pytest.mark.parametrize("address", BAD_ADDRESSES)
def test_bad_aggregator_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match=r"--aggregator: .* is not HOST:PORT"):
        AgentFlags(aggregator=address)


@pytest.mark.parametrize("address", ["garbage", "127.0.0.1:99999", "127.0.0.1:1,garbage"])
def test_a_bad_aggregator_address_exits_2(address: str) -> None:
    completed = run_agent("--aggregator", address)
    assert completed.returncode == 2, completed.stderr
    assert "is not HOST:PORT" in completed.stderr


# -- --proxy-url ----------------------------------------------------------------------------

GOOD_URLS = [
    "http://127.0.0.1:8000/-/healthz",
    "http://127.0.0.1/-/healthz",
    "https://proxy:8443/-/healthz",
    "http://[::1]:8000/-/healthz",
    "http://proxy.ray.svc:8000/-/healthz?x=1",
    "http://127.0.0.1:65535/",
]
BAD_URLS = [
    "garbage",
    "127.0.0.1:8000",
    "ftp://127.0.0.1/-/healthz",
    "http://[::1",
    "http://[::1/-/healthz",
    "http://127.0.0.1:99999/",
    "http://127.0.0.1:65536/",
    "http://127.0.0.1:0/",
    "http://127.0.0.1:port/",
    "http:///-/healthz",
    "http://:8000/-/healthz",
    "http://127.0.0.1:8000/a b",
]


@pytest.mark.parametrize("url", GOOD_URLS)
def test_good_proxy_urls(url: str) -> None:
    AgentFlags(aggregator="agg:1", proxy_url=url)


@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_proxy_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="--proxy-url"):
        AgentFlags(aggregator="agg:1", proxy_url=url)


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999/"])
def test_a_bad_proxy_url_exits_2(url: str) -> None:
    completed = run_agent("--aggregator", "127.0.0.1:1", "--proxy-url", url)
    assert completed.returncode == 2, completed.stderr
    assert "--proxy-url" in completed.stderr


@pytest.mark.parametrize(
    ("url", "port", "address"),
    [
        ("http://127.0.0.1:8000/-/healthz", 9000, "127.0.0.1:9000"),
        ("http://[::1]:8000/-/healthz", 9000, "[::1]:9000"),
        ("http://localhost:8000/-/healthz", 9100, "localhost:9100"),
        ("http://127.0.0.1:8000/-/healthz", 0, None),
    ],
)
def test_the_grpc_proxy_is_on_the_host_of_the_proxy_url(
    url: str, port: int, address: str | None
) -> None:
    settings = AgentFlags(aggregator="agg:1", proxy_url=url, grpc_proxy_port=port)
    assert settings.grpc_proxy_address == address


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_bad_grpc_proxy_port_is_refused(port: int) -> None:
    with pytest.raises(ValueError, match="--grpc-proxy-port"):
        AgentFlags(aggregator="agg:1", grpc_proxy_port=port)


def test_a_bad_grpc_proxy_port_exits_2() -> None:
    completed = run_agent("--aggregator", "127.0.0.1:1", "--grpc-proxy-port", "70000")
    assert completed.returncode == 2, completed.stderr
    assert "--grpc-proxy-port" in completed.stderr
