"""The aggregator's leader-election settings (``--leader-elect*``), declared as a group.

Each constant is the :func:`~servehealth_common.config.setting` of one field of
:class:`aggregator.flags.AggregatorFlags` (as :mod:`servehealth_common.flags` declares the
shared ones), and :func:`check` validates them together.

The timings' defaults, lease 8 s, renew deadline 6 s, retry 1 s (each Lease request gets 3 s),
ride out an API server that answers 1 % of its requests in seconds (p99 1 s) without losing the
leader; lease 3 s / renew 2 s / retry 500 ms, the defaults before, failed over by themselves
about twice an hour there, and in cascades when the machine was busy. The price: a standby
takes over about 9 s after the leader dies (3 s before). docs/benchmarks.md ("Leader election
on a slow API server") has the figures; docs/operations.md ("High availability") the choice.
"""

from __future__ import annotations

import re

from servehealth_common.config import setting

#: A label key: an optional DNS-subdomain prefix and "/", then a name of at most 63 characters.
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

ENABLED = setting(
    False,
    "Run as one of several replicas: only the holder of a coordination.k8s.io Lease "
    "(the leader) accepts reports and writes to the API (and carries --leader-label); a "
    'standby refuses reports, answers NOT_SERVING on grpc.health.v1 (service "") and '
    "takes over when the leader is gone. Needs the kubernetes backend.",
)

LEASE_DURATION = setting(
    8.0,
    "How long a standby waits, after it last saw the Lease change, before it takes the "
    "Lease over (whole seconds: the Lease stores leaseDurationSeconds).",
    duration=True,
)

RENEW_DEADLINE = setting(
    6.0,
    "The leader gives up (and exits) when it could not renew the Lease for this long; "
    "shorter than --leader-elect-lease-duration.",
    duration=True,
)

RETRY_PERIOD = setting(
    1.0,
    "How often the leader renews the Lease and a standby looks at it (jittered); each "
    "Lease request has a deadline of half --leader-elect-renew-deadline.",
    duration=True,
)

LEASE_NAME = setting(
    "ray-serve-health-aggregator", "Name of the Lease the replicas elect a leader with."
)

NAMESPACE = setting(
    "",
    "Namespace of the Lease; without it, $POD_NAMESPACE, then the pod's own namespace "
    "(the in-cluster ServiceAccount's namespace file).",
    shown="(own namespace)",
)

IDENTITY = setting(
    "",
    "This replica's holderIdentity in the Lease; must differ between replicas. Without "
    "it, $POD_NAME (or the host name) plus a random suffix.",
    shown="(POD_NAME_random)",
)

LABEL = setting(
    "ray-serve-health/leader",
    'With --leader-elect: the leader sets this label to "true" on its own pod '
    "($POD_NAME, in its namespace) and removes it from the other pods there; the "
    "aggregator's Service selects it, so every replica can be Ready and agents still "
    "reach the leader only. Empty: no label (then only the leader should be Ready).",
)


def check(
    *,
    enabled: bool,
    dry_run: bool = False,
    memory_backend: bool,
    duration: float,
    deadline: float,
    retry: float,
    lease_name: str,
    label: str,
) -> None:
    """Validate the leader-election settings (the Lease's duration, renew deadline and retry
    period, its name, the leader label); ValueError naming the flag."""
    if dry_run and enabled:
        raise ValueError(
            "--dry-run writes nothing to the API, not even the Lease --leader-elect needs: "
            "run one replica without --leader-elect (as deploy/overlays/shadow-mode does)"
        )
    if enabled and memory_backend:
        raise ValueError(
            "--leader-elect needs the kubernetes backend (the Lease lives in the API); "
            "--kube-backend memory keeps everything in one process"
        )
    if duration < 1 or duration != int(duration):
        raise ValueError(
            f"--leader-elect-lease-duration ({duration:g}s) must be a whole number of "
            "seconds, at least 1 (the Lease stores leaseDurationSeconds)"
        )
    if not duration > deadline > retry * 1.2 > 0:
        raise ValueError(
            f"leader election needs --leader-elect-lease-duration ({duration:g}s) > "
            f"--leader-elect-renew-deadline ({deadline:g}s) > 1.2 x "
            f"--leader-elect-retry-period ({retry:g}s) > 0: the leader must give up before "
            "a standby may take over, and have time to retry within the deadline"
        )
    if not lease_name:
        raise ValueError("--leader-elect-lease-name must not be empty")
    # The label's key: [prefix/]name.
    prefix, slash, name = label.rpartition("/")
    if label and (
        not _LABEL_NAME.fullmatch(name)
        or (slash and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix)))
    ):
        raise ValueError(
            f"--leader-label {label[:300]!r} is not a label key: [PREFIX/]NAME, NAME at most 63 "
            "letters, digits, '-', '_' or '.', PREFIX a DNS subdomain"
        )
