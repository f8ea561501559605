"""Regenerate the configuration reference from the settings dataclasses.

    python scripts/gen_docs.py          # rewrite README.md's flag tables and docs/configuration.md
    python scripts/gen_docs.py --check  # exit 1 if either is out of date

In README.md the tables sit between ``<!-- flags:NAME -->`` and ``<!-- /flags:NAME -->``
markers; docs/configuration.md is generated whole. tests/docs/test_readme.py and
tests/deploy/test_docs.py run the check.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

from aggregator.flags import AggregatorFlags
from node_agent.flags import AgentFlags
from servehealth_common.config import ENV_PREFIX, describe

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
TABLES = {"aggregator": AggregatorFlags, "agent": AgentFlags}
COMMANDS = {"aggregator": "serve-health-aggregator", "agent": "serve-health-agent"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(cls: type) -> str:
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for row in describe(cls):
        lines.append(
            f"| `{row['flag']}` | `{row['env']}` | `{row['default']}` | {_cell(row['help'])} |"
        )
    return "\n".join(lines)


def value_kind(field: dataclasses.Field[typing.Any], hint: typing.Any) -> str:
    """What a setting accepts, for the reference: its choices, or its type."""
    if field.metadata.get("choices"):
        return " \\| ".join(f"`{choice}`" for choice in field.metadata["choices"])
    if field.metadata.get("duration"):
        return "duration"
    if typing.get_origin(hint) is tuple:
        return "list"
    return {bool: "boolean", int: "integer", float: "number"}.get(hint, "string")


def reference_table(cls: type) -> str:
    """Like :func:`table`, with a column saying what each setting accepts."""
    hints = typing.get_type_hints(cls)
    kinds = {f.name: value_kind(f, hints[f.name]) for f in dataclasses.fields(cls)}
    lines = [
        "| flag | environment | default | accepts | meaning |",
        "|---|---|---|---|---|",
    ]
    for field, row in zip(dataclasses.fields(cls), describe(cls), strict=True):
        lines.append(
            f"| `{row['flag']}` | `{row['env']}` | `{row['default']}` | {kinds[field.name]} "
            f"| {_cell(row['help'])} |"
        )
    return "\n".join(lines)


def render(text: str) -> str:
    for name, cls in TABLES.items():
        pattern = re.compile(
            rf"(<!-- flags:{name} -->\n).*?(<!-- /flags:{name} -->)", flags=re.DOTALL
        )
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- flags:{name} --> section")
        text = pattern.sub(lambda m, c=cls: m.group(1) + table(c) + "\n" + m.group(2), text)
    return text


LISTEN_ADDRESSES = """### Listen addresses

`--listen` (gRPC) and `--metrics-listen` (/metrics) default to `0.0.0.0`, every address of the
network namespace the aggregator runs in. That is deliberate:

- **In a pod** that namespace is the pod's own: its loopback and its pod IP, nothing of the
  node's. Agents on other nodes reach the gRPC port through the Service, the kubelet's gRPC
  probes reach the pod IP, and Prometheus scrapes the pod IP (the `prometheus.io/*`
  annotations of the Deployment). `127.0.0.1` would shut all of them out; the pod IP, the only
  other address there is, is not known before the pod starts, and binding it (from
  `status.podIP`) would expose nothing less.
- **What limits exposure** is who can reach the pod IP and what each port lets a client do. A
  NetworkPolicy admits agents to 50051 and Prometheus to 9090 and nobody else (an example is in
  [install.md](install.md)). The gRPC port checks agents' tokens (`--auth tokenreview`) and
  bounds connections: `--max-connections`, `--handshake-timeout`, keepalive,
  `--max-connection-idle`, `--max-streams-per-peer`. The /metrics port is read-only and bounded
  against hostile clients: a request head must arrive within 5 s and be at most 16 KiB, a
  kept-alive connection idles 30 s at most, and at most 64 connections are open at once (one
  more is closed as it arrives). A flood of half-sent requests to /metrics thus holds at most
  64 file descriptors and never starves the gRPC port, though scrapes can be refused while it
  lasts.
- **Outside a pod** (a machine of its own, or `hostNetwork: true`) `0.0.0.0` is every interface
  of the machine: pass `--listen 127.0.0.1:50051 --metrics-listen 127.0.0.1:9090`, or the one
  address that should serve, or `--metrics-listen ""` to turn /metrics off.
- **At start** a port already in use (by another aggregator too: the gRPC port is never shared,
  gRPC's SO_REUSEPORT is off), a host name that does not resolve or an address this machine
  does not have stops the aggregator with one line, `cannot start: cannot listen on
  127.0.0.1:50051 (--listen): address already in use`, exit status 1. Once started, it logs
  the addresses bound, with the ports that port 0 picked:
  `listening on 0.0.0.0:50051 (plaintext, metrics 0.0.0.0:9090)`.
"""


def configuration() -> str:
    """docs/configuration.md, whole."""
    example = describe(AggregatorFlags)[0]
    return f"""<!-- Generated by scripts/gen_docs.py from aggregator/flags.py and \
node_agent/flags.py (shared: servehealth_common/flags.py). Do not edit: change the flags, \
then run python scripts/gen_docs.py. -->

# Configuration reference

Both commands read every setting from a flag or from an environment variable; the two tables
below are generated from the settings dataclasses, so they list every setting there is.

- **The environment rule.** A flag `--some-name` is also the environment variable
  `{ENV_PREFIX}SOME_NAME`: the prefix `{ENV_PREFIX}`, then the flag's name in upper case with
  dashes turned into underscores (`{example["flag"]}` is `{example["env"]}`).
- **Precedence.** A flag wins over the environment, which wins over the default.
- **Values.** A *duration* is `500ms`, `3s`, `1m`, `1h` or plain seconds (`2.5`); a negative
  one (`--heartbeat-ttl -1s`) is read as such and refused by the check of its setting. A
  *boolean* is a switch: the flag alone (`--dry-run`) means true; a value is `true`/`false`
  (also `1`/`0`, `yes`/`no`, `on`/`off`: `--dry-run=false`). Deprecated flags
  (`--heartbeat-interval`, for agents before 0.2.0) are accepted and
  listed here, not on `--help`. A *list* setting is a flag given
  once per value (`--namespace a --namespace b`), or one comma-separated variable
  (`{ENV_PREFIX}NAMESPACE=a,b`).
- **Errors.** A bad value (from a flag, or from a variable that no flag overrides) stops the
  command with a usage error naming the setting and the value, exit status 2: a duration or a
  number out of its range, a port outside 0-65535, an IP address that is none (`256.1.1.1`), a
  TLS file that is not PEM or a key that is not its certificate's. What is only known when the
  aggregator starts (see [Listen addresses](#listen-addresses)) is one line `cannot start: ...`
  and exit status 1.
- **On Kubernetes** the manifests in `deploy/` set the environment variables (`env:` of the
  container), so that an overlay can change one setting with a strategic merge patch that
  names just that variable; see [install.md](install.md).

## `{COMMANDS["aggregator"]}`

{reference_table(AggregatorFlags)}

{LISTEN_ADDRESSES}
## `{COMMANDS["agent"]}`

Identity comes from the downward API, not from flags: `POD_NAMESPACE`, `POD_NAME`, `POD_UID`,
`NODE_NAME` (`fieldRef` `metadata.namespace`, `metadata.name`, `metadata.uid`,
`spec.nodeName`). The agent refuses to start, naming the missing variables, without them.

{reference_table(AgentFlags)}
"""


def main() -> int:
    outputs = {README: render(README.read_text()), CONFIGURATION: configuration()}
    if "--check" in sys.argv[1:]:
        stale = [
            path.relative_to(ROOT).as_posix()
            for path, fresh in outputs.items()
            if not path.is_file() or path.read_text() != fresh
        ]
        if stale:
            print(f"out of date: {', '.join(stale)}: run python scripts/gen_docs.py")
            return 1
        return 0
    for path, fresh in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
