"""The aggregator's leader-election settings (``--leader-elect*``), declared as a group.

Each function returns a fresh :func:`~servehealth_common.config.setting` for one field of
:class:`aggregator.flags.AggregatorFlags` (as :mod:`servehealth_common.flags` does for the
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
from typing import Any

from servehealth_common.config import setting

#: A label key: an optional DNS-subdomain prefix and "/", then a name of at most 63 characters.
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def enabled() -> Any:
    return setting(
        False,
        "Run as one of several replicas: only the holder of a coordination.k8s.io Lease "
        "(the leader) accepts reports and writes to the API (and carries --leader-label); a "
        'standby refuses reports, answers NOT_SERVING on grpc.health.v1 (service "") and '
        "takes over when the leader is gone. Needs the kubernetes backend.",
    )


def lease_duration() -> Any:
    return setting(
        8.0,
        "How long a standby waits, after it last saw the Lease change, before it takes the "
        "Lease over (whole seconds: the Lease stores leaseDurationSeconds).",
        duration=True,
    )


def renew_deadline() -> Any:
    return setting(
        6.0,
        "The leader gives up (and exits) when it could not renew the Lease for this long; "
        "shorter than --leader-elect-lease-duration.",
        duration=True,
    )


def retry_period() -> Any:
    return setting(
        1.0,
        "How often the leader renews the Lease and a standby looks at it (jittered); each "
        "Lease request has a deadline of half --leader-elect-renew-deadline.",
        duration=True,
    )


def lease_name() -> Any:
    return setting(
        "ray-serve-health-aggregator", "Name of the Lease the replicas elect a leader with."
    )


def namespace() -> Any:
    return setting(
        "",
        "Namespace of the Lease; without it, $POD_NAMESPACE, then the pod's own namespace "
        "(the in-cluster ServiceAccount's namespace file).",
        shown="(own namespace)",
    )


def identity() -> Any:
    return setting(
        "",
        "This replica's holderIdentity in the Lease; must differ between replicas. Without "
        "it, $POD_NAME (or the host name) plus a random suffix.",
        shown="(POD_NAME_random)",
    )


def label() -> Any:
    return setting(
        "ray-serve-health/leader",
        'With --leader-elect: the leader sets this label to "true" on its own pod '
        "($POD_NAME, in its namespace) and removes it from the other pods there; the "
        "aggregator's Service selects it, so every replica can be Ready and agents still "
        "reach the leader only. Empty: no label (then only the leader should be Ready).",
    )


def check_label_key(key: str, flag: str) -> None:
    """ValueError unless ``key`` is a valid label key (``[prefix/]name``)."""
    prefix, slash, name = key.rpartition("/")
    if not _LABEL_NAME.fullmatch(name) or (
        slash and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix))
    ):
        raise ValueError(
            f"{flag} {key[:300]!r} is not a label key: [PREFIX/]NAME, NAME at most 63 letters, "
            "digits, '-', '_' or '.', PREFIX a DNS subdomain"
        )


def check(
    *,
    enabled: bool,
    dry_run: bool = False,
    memory_backend: bool,
    lease_duration: float,
    renew_deadline: float,
    retry_period: float,
    lease_name: str,
    label: str,
) -> None:
    """Validate the leader-election settings; ValueError naming the flag."""
    duration, deadline, retry = lease_duration, renew_deadline, retry_period
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
    if label:
        check_label_key(label, "--leader-label")
