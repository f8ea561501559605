"""``serve-health-cleanup``: after the aggregator is stopped, give the Ray pods back to KubeRay.

Uninstalling leaves what the aggregator wrote: workers at ``ray.io/serve=false`` for ever (KubeRay
sets a worker's label only when it creates the pod), gated pods whose condition was False
NotReady for ever. This command puts each pod back the way KubeRay expects it, as
:mod:`aggregator.cleanup.rules` decides (its docstring has the table and the KubeRay sources),
and prints every change and a summary line.

Give it the aggregator's ``--mode``, ``--label-key``, ``--condition-type`` and
``--pod-selector`` (same flags, same ``SERVE_HEALTH_*`` variables, same defaults). It refuses
(exit 2), unless ``--force``, while the aggregator's leader-election Lease is held and renewed
(a running aggregator would write everything back), and when agents in fallback wrote pods
after the aggregator went away (they would write back what it changes:
:mod:`aggregator.cleanup.agents`); after its changes it looks again, ``--verify-for``, for
agents that wrote any pod since it started. Exit 0: nothing failed; 1: some pod could not be
cleaned up, or agents wrote pods back (or the API did not answer); 2: refused, or a usage
error.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from aggregator.cleanup import agents as cleanup_agents
from aggregator.cleanup.kube import Cleaner, CleanupSettings, Retrier, last_renewal, live_holder
from aggregator.cleanup.rules import CleanupRules
from aggregator.flags import AggregatorFlags
from aggregator.kube.api import KubeApi
from aggregator.leader.lease import KubeLeaseStore, LeaderElectionConfigError, lease_namespace
from servehealth_common import flags as shared
from servehealth_common import logs, runtime
from servehealth_common.config import load, setting
from servehealth_common.kube.client import NoKubeConfig, load_configuration
from servehealth_common.kube.errors import APIError
from servehealth_common.pod_writes.times import micro_time

log = logging.getLogger("aggregator.cleanup.cli")

PROG = "serve-health-cleanup"
DESCRIPTION = (
    "Return Ray pods to what KubeRay expects once the ray-serve-health aggregator is stopped: "
    "put back or remove the serve label, set gated pods' condition True (or remove it)."
)
#: Where the Lease is looked for when no namespace is given or found (the deploy/ overlays').
DEFAULT_LEASE_NAMESPACE = "ray-serve-health"
EXIT_FAILED = 1
EXIT_REFUSED = 2

#: The aggregator's default of each of its flags (so the two cannot drift apart).
_AGGREGATORS: dict[str, Any] = {field.name: field.default for field in fields(AggregatorFlags)}


@dataclass(frozen=True)
class CleanupFlags:
    mode: str = setting(
        _AGGREGATORS["mode"],
        "What the aggregator wrote (its --mode): label, condition or both.",
        choices=("label", "condition", "both"),
    )
    label_key: str = setting(
        _AGGREGATORS["label_key"],
        "The aggregator's --label-key. ray.io/serve (KubeRay's): RayService workers get "
        '"true" back, RayService heads are left to KubeRay, other pods lose it; any other '
        "key: removed from every pod.",
    )
    condition_type: str = setting(
        _AGGREGATORS["condition_type"],
        "The aggregator's --condition-type: set True (reason RayServeHealthUninstalled) on "
        "pods whose readiness gates name it, removed from the others.",
    )
    pod_selector: str = shared.pod_selector_flag()
    namespace: tuple[str, ...] = shared.namespace_flag()
    kubeconfig: str = shared.kubeconfig_flag()
    dry_run: bool = setting(False, "Print what would change; change nothing.")
    force: bool = setting(
        False,
        "Clean up even while the aggregator's Lease is held (it would write its values back), "
        "or after agents in fallback wrote pods since the aggregator went away (they would "
        "write back what this changes: stop them first, docs/install.md).",
    )
    fallback_window: float = setting(
        600.0,
        "Without a Lease record of the aggregator (no --leader-elect), how far back a mark of "
        "an agent's fallback write (its annotation, a NoAggregator condition) counts as an "
        "agent still writing; with one, the marks after its last renewal or release count.",
        duration=True,
    )
    lease_name: str = setting(
        _AGGREGATORS["leader_elect_lease_name"],
        "Name of the aggregator's leader-election Lease (its --leader-elect-lease-name).",
    )
    lease_namespace: str = setting(
        "",
        "Namespace of that Lease; without it, $POD_NAMESPACE, then the pod's own namespace, "
        f"then {DEFAULT_LEASE_NAMESPACE}.",
        shown=f"(own namespace, else {DEFAULT_LEASE_NAMESPACE})",
    )
    verify_for: float = setting(
        15.0,
        "After the changes, wait this long, list the pods again and fail (exit 1) if agents "
        "in fallback wrote any since this run started: they would keep writing back what it "
        "changed (an agent with nothing to write before leaves no mark for the check before "
        "the changes). Agents in a large fleet write within 2 x fleet size / their "
        "--fallback-api-budget seconds. 0: no second look.",
        duration=True,
    )
    kube_timeout: float = shared.kube_timeout_flag()
    kube_qps: float = setting(20.0, "Sustained writes per second (client-side token bucket).")
    kube_burst: int = setting(40, "Writes allowed in a burst above --kube-qps.")
    kube_concurrency: int = setting(16, "Kubernetes API requests in flight at most.")
    max_attempts: int = setting(
        10,
        "Attempts of one API call answered 429, 5xx or 409, timed out or cut (backoff 0.2 s "
        "to 30 s, honouring Retry-After); then that pod counts as failed.",
    )
    log_level: str = shared.log_level_flag()
    log_format: str = shared.log_format_flag()

    def __post_init__(self) -> None:
        if not self.kube_timeout > 0:
            raise ValueError("--kube-timeout must be positive")
        if not self.label_key or not self.condition_type:
            raise ValueError("--label-key and --condition-type must not be empty")
        if self.fallback_window < 0 or self.verify_for < 0:
            raise ValueError("--fallback-window and --verify-for must not be negative")
        if not self.kube_qps > 0:
            raise ValueError(f"--kube-qps must be positive (got {self.kube_qps:g})")
        for name in ("kube_burst", "kube_concurrency", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


#: One line of the command's report, on stdout (logs go to stderr).
out = functools.partial(print, flush=True)


def where_lease(flags: CleanupFlags) -> str:
    try:
        return lease_namespace(flags.lease_namespace, os.environ)
    except LeaderElectionConfigError:
        return DEFAULT_LEASE_NAMESPACE


async def lease_refusal(flags: CleanupFlags, store: KubeLeaseStore, retrier: Retrier) -> int | None:
    """The exit code to stop with (logged), or None to go on: refused (2) while the
    aggregator's Lease is held and renewed, or cannot be read (403, ...), unless --force or
    --dry-run; failed (1) when the API does not answer."""
    lease = f"the aggregator's Lease {store.describe()}"
    try:
        holder = await live_holder(store, retrier, watch=not flags.force)
    except APIError as error:
        if flags.force or flags.dry_run:
            log.warning("cannot read %s (%s); going on (--force or --dry-run)", lease, error)
            return None
        if error.retryable:
            log.error("cannot read %s: %s (the Kubernetes API does not answer)", lease, error)
            return EXIT_FAILED
        log.error(
            "refusing to clean up: cannot read %s (%s), so the aggregator may be running; "
            "check it is stopped, then pass --force (or --lease-namespace, --lease-name)",
            lease,
            error,
        )
        return EXIT_REFUSED
    if not holder:
        log.info("%s is not held: no aggregator is running", lease)
        return None
    if flags.force:
        log.warning("%s is held by %s; --force: cleaning up anyway", lease, holder)
        return None
    stop = (
        f"stop the aggregator first (kubectl -n {store.namespace} scale deployment/"
        f"ray-serve-health-aggregator --replicas=0) or pass --force"
    )
    if flags.dry_run:
        log.warning(
            "%s is held by %s: without --dry-run this would refuse; %s", lease, holder, stop
        )
        return None
    log.error(
        "refusing to clean up: %s is held by %s and renewed, so an aggregator is running and "
        "would write back everything this changes; %s",
        lease,
        holder,
        stop,
    )
    return EXIT_REFUSED


async def agents_refusal(
    flags: CleanupFlags,
    store: KubeLeaseStore,
    retrier: Retrier,
    pods: list[dict[str, Any]],
    started: datetime.datetime,
) -> int | None:
    """The exit code to stop with (logged), or None to go on: refused (2) when agents in
    fallback wrote pods after the aggregator went away, unless --force or --dry-run."""
    renewed = await last_renewal(store, retrier)
    after = cleanup_agents.since(renewed, started, flags.fallback_window)
    writes = cleanup_agents.agent_writes(pods, after)
    if not writes:
        return None
    judged = (
        f"{renewed} (when the aggregator's Lease {store.describe()} was last renewed or released)"
        if renewed
        else f"{micro_time(after)} (--fallback-window before this run)"
    )
    if flags.force:
        found = cleanup_agents.evidence(writes, judged)
        log.warning("%s; --force: cleaning up anyway (they may write it back)", found)
        return None
    why = cleanup_agents.refusal(writes, judged, store.namespace)
    if flags.dry_run:
        log.warning("without --dry-run this would refuse: %s", why)
        return None
    log.error("%s", why)
    return EXIT_REFUSED


async def clean(flags: CleanupFlags, api: KubeApi) -> int:
    """Check, then clean up; the exit code."""
    started = datetime.datetime.now(datetime.UTC)
    retrier = Retrier(flags.max_attempts)
    store = KubeLeaseStore(api, where_lease(flags), flags.lease_name)
    refusal = await lease_refusal(flags, store, retrier)
    if refusal is not None:
        return refusal
    rules = CleanupRules(flags.mode, flags.label_key, flags.condition_type)
    settings = CleanupSettings(**{f.name: getattr(flags, f.name) for f in fields(CleanupSettings)})
    cleaner = Cleaner(api, rules, settings, out, retrier)
    try:
        pods = await cleaner.pods()
    except APIError as error:
        log.error("cannot list the Ray pods: %s", error)
        return EXIT_FAILED
    refusal = await agents_refusal(flags, store, retrier, pods, started)
    if refusal is not None:
        return refusal
    tally = await cleaner.apply(pods)
    out(tally.summary(flags.dry_run))
    if tally.failed:
        return EXIT_FAILED
    return await written_back(flags, cleaner, started)


async def written_back(flags: CleanupFlags, cleaner: Cleaner, started: datetime.datetime) -> int:
    """After the changes, for --verify-for: 0, or 1 (logged) when agents in fallback wrote
    pods since this run started (they write back what it changed), or the pods cannot be
    listed again."""
    if flags.dry_run or not flags.verify_for:
        return 0
    log.info(
        "watching for %gs that no agent in fallback writes back what this changed",
        flags.verify_for,
    )
    await asyncio.sleep(flags.verify_for)
    try:
        pods = await cleaner.pods()
    except APIError as error:
        log.error("cannot list the Ray pods again, to check nothing wrote them back: %s", error)
        return EXIT_FAILED
    writes = cleanup_agents.agent_writes(pods, started)
    if not writes:
        return 0
    for write in writes:
        out(f"{write.key}: written back by an agent in fallback")
    after = f"{micro_time(started)} (when this run started)"
    log.error("%s", cleanup_agents.written_back(writes, after, where_lease(flags)))
    return EXIT_FAILED


async def run(flags: CleanupFlags) -> int:
    configuration = load_configuration(flags.kubeconfig)
    configuration.retries = 0  # the Retrier retries, counting and logging every attempt
    api = KubeApi(
        configuration,
        timeout=flags.kube_timeout,
        concurrency=flags.kube_concurrency,
        user_agent="ray-serve-health/cleanup",
    )
    try:
        return await clean(flags, api)
    finally:
        api.close()


def main(argv: Sequence[str] | None = None) -> int:
    flags = load(CleanupFlags, argv, os.environ, PROG, DESCRIPTION)
    logs.setup(flags.log_level, flags.log_format)
    try:
        return runtime.run(run(flags))
    except NoKubeConfig as error:
        log.error("cannot start: %s", error)
        return EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
