"""The figures of one :mod:`bench.ingest` run, from what its processes reported."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

LABEL = "ray.io/serve"
#: The load is the bottleneck when its event loop lags this much (seconds), or its processes
#: use more than this share of their core.
LAG_P99_LIMIT = 0.050
LAG_MAX_LIMIT = 0.500
LOAD_CPU_LIMIT = 90.0
AGGREGATOR_CPU_LIMIT = 90.0
P99_LIMIT_MS = 1000.0


@dataclass
class Result:
    agents: int
    protocol: str
    connections: int
    load_processes: int
    duration_s: float
    # What the aggregator asked for (AgentSettings; the value most agents last received).
    heartbeat_interval_s: float | None
    resync_interval_s: float | None
    reports_per_change: int | None
    settings_seen: dict[str, int]
    aggregator_args: list[str]
    keepalive_flags: dict[str, str]  # empty: the aggregator's defaults
    # Throughput: reports the aggregator counted, messages the load sent (one report each).
    messages_per_s: float
    reports_per_s: float
    messages_per_s_per_agent: float
    load_messages_per_s: float
    acks: int
    # The aggregator.
    aggregator_cpu_percent: float
    aggregator_rss_mib: float
    rss_empty_mib: float
    rss_pods_mib: float
    bytes_per_agent: float  # (RSS with N agents connected - RSS empty) / N
    bytes_per_connected_agent: float  # (RSS with N agents connected - RSS with the pods) / N
    aggregator_fds: int
    aggregator_exited: bool
    # Latency: the change leaves the agent -> the label "false" PATCH reaches the emulator.
    flips: int
    flips_written: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float | None
    slowest_flips: list[list[Any]]  # [seconds into the window, latency ms, pod]
    # Streams.
    agents_connected: int
    stream_errors: int
    reconnects: int
    connect_retries: int
    error_samples: list[str]
    # The load (all its processes, on core 1 with the emulator).
    load_cpu_percent: float
    load_rss_mib: float
    emulator_cpu_percent: float
    load_lag_p50_ms: float | None
    load_lag_p99_ms: float | None
    load_lag_max_ms: float | None
    load_late_sends: int
    load_bottleneck: bool
    # Whose stall, when latency has outliers: health checks of the aggregator every 100 ms
    # (p99 and [seconds into the window, ms] of the slowest), the emulator's event-loop lag.
    aggregator_check_p99_ms: float | None
    aggregator_check_max: list[float] | None
    emulator_lag_max: list[float] | None
    # The emulator's garbage collections over 50 ms in the window ([generation, s, ms]; its
    # collector is off during the window, so none are expected).
    emulator_slow_gcs: list[list[float]]
    log_dir: str

    def failures(self) -> list[str]:
        """Why this run does not hold (empty: it holds)."""
        why = []
        if self.load_bottleneck:
            why.append("the load generator was the bottleneck")
        if self.agents_connected < self.agents:
            why.append(f"{self.agents - self.agents_connected} agents never connected")
        if self.flips == 0 or self.flips_written < self.flips:
            why.append(f"{self.flips_written} of {self.flips} flips written")
        if self.latency_p99_ms is None or self.latency_p99_ms >= P99_LIMIT_MS:
            why.append(f"p99 {self.latency_p99_ms} ms")
        if self.stream_errors:
            why.append(f"{self.stream_errors} streams ended by the other side")
        if self.aggregator_cpu_percent >= AGGREGATOR_CPU_LIMIT:
            why.append(f"aggregator CPU {self.aggregator_cpu_percent} %")
        if self.aggregator_exited:
            why.append("the aggregator exited")
        return why

    @property
    def holds(self) -> bool:
        return not self.failures()

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "holds": self.holds, "not_holding": self.failures()}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank)."""
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _worst(
    samples: list[tuple[float, float]], measure_from: float
) -> tuple[float | None, list[float] | None]:
    """p99 (ms) of (when, seconds) samples, and [seconds into the window, ms] of the largest."""
    if not samples:
        return None, None
    durations = sorted(took for _, took in samples)
    when, took = max(samples, key=lambda sample: sample[1])
    return _ms(percentile(durations, 0.99)), [round(when - measure_from, 2), _ms(took) or 0.0]


def keepalive_flags(args: list[str]) -> dict[str, str]:
    """The --keepalive-* flags among the aggregator's extra arguments."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--keepalive"):
            name, equals, value = arg.partition("=")
            if not equals:
                value = args[i + 1] if i + 1 < len(args) else ""
            flags[name] = value
    return flags


def latencies(
    flips: list[tuple[str, float]], patches: list[tuple[str, dict[str, str], float]]
) -> list[tuple[float, float, str]]:
    """(seconds until the first ``false`` PATCH of its pod after it, t0, pod) of each flip
    written, sorted."""
    falses: dict[str, list[float]] = {}
    for name, labels, at in patches:
        if labels.get(LABEL) == "false":
            falses.setdefault(name, []).append(at)
    found = []
    for name, t0 in flips:
        later = [at for at in falses.get(name, []) if at >= t0]
        if later:
            found.append((min(later) - t0, t0, name))
    return sorted(found)


def _settings(stats: list[dict[str, Any]]) -> tuple[dict[str, int], tuple[Any, Any, Any]]:
    """The settings agents had at the end: each variant with its count, and the commonest."""
    seen: Counter[tuple[float, float, int]] = Counter()
    for one in stats:
        for heartbeat, resync, per_change, count in one["settings"]:
            seen[(heartbeat, resync, per_change)] += count
    shown = {
        f"heartbeat {h:g}s, resync {r:g}s, reports_per_change {p}": count
        for (h, r, p), count in seen.most_common()
    }
    return shown, (seen.most_common(1)[0][0] if seen else (None, None, None))


def summarise(
    *,
    agents: int,
    options: dict[str, Any],
    connections: int,
    stats: list[dict[str, Any]],
    patches: list[tuple[str, dict[str, str], float]],
    cpu: list[float],
    rss: tuple[int, int, int],
    load_rss: list[int],
    fds: int,
    reports: float,
    exited: bool,
    log_dir: str,
    measure_from: float,
    stalls: tuple[
        list[tuple[float, float]], list[tuple[float, float]], list[tuple[int, float, float]]
    ],
) -> Result:
    duration = options["duration"]
    flips = [flip for one in stats for flip in one["flips"]]
    written = latencies(flips, patches)
    found = [latency for latency, _, _ in written]
    slowest = [
        [round(t0 - measure_from, 2), _ms(latency), name] for latency, t0, name in written[-5:]
    ]
    lags = sorted(lag for one in stats for lag in one["lags"])
    samples = [sample for one in stats for sample in one["error_samples"]][:10]
    seen, (heartbeat, resync, per_change) = _settings(stats)
    rss_empty, rss_pods, rss_now = rss
    aggregator_cpu, emulator_cpu, *load_cpus = cpu
    load_cpu = round(sum(load_cpus) * 100, 1)
    lag_p99 = percentile(lags, 0.99) if lags else None
    lag_max = lags[-1] if lags else None
    bottleneck = (
        lag_p99 is None
        or lag_p99 > LAG_P99_LIMIT
        or (lag_max is not None and lag_max > LAG_MAX_LIMIT)
        or load_cpu > LOAD_CPU_LIMIT
    )
    extra = list(options.get("aggregator_arg") or [])
    checks, emulator_lags, emulator_gcs = stalls
    check_p99, check_max = _worst(checks, measure_from)
    _, emulator_max = _worst(emulator_lags, measure_from)
    return Result(
        agents=agents,
        protocol=options["protocol"],
        connections=connections,
        load_processes=len(stats),
        duration_s=duration,
        heartbeat_interval_s=heartbeat,
        resync_interval_s=resync,
        reports_per_change=per_change,
        settings_seen=seen,
        aggregator_args=extra,
        keepalive_flags=keepalive_flags(extra),
        messages_per_s=round(reports / duration, 1),
        reports_per_s=round(reports / duration, 1),
        messages_per_s_per_agent=round(reports / duration / agents, 3),
        load_messages_per_s=round(sum(one["sent_in_window"] for one in stats) / duration, 1),
        acks=sum(one["acks"] for one in stats),
        aggregator_cpu_percent=round(aggregator_cpu * 100, 1),
        aggregator_rss_mib=round(rss_now / 2**20, 1),
        rss_empty_mib=round(rss_empty / 2**20, 1),
        rss_pods_mib=round(rss_pods / 2**20, 1),
        bytes_per_agent=round((rss_now - rss_empty) / agents),
        bytes_per_connected_agent=round((rss_now - rss_pods) / agents),
        aggregator_fds=fds,
        aggregator_exited=exited,
        flips=len(flips),
        flips_written=len(found),
        latency_p50_ms=_ms(statistics.median(found)) if found else None,
        latency_p99_ms=_ms(percentile(found, 0.99)) if found else None,
        latency_max_ms=_ms(found[-1]) if found else None,
        slowest_flips=slowest[::-1],
        agents_connected=sum(one["connected"] for one in stats),
        stream_errors=sum(one["stream_errors"] for one in stats),
        reconnects=sum(one["reconnects"] for one in stats),
        connect_retries=sum(one["connect_retries"] for one in stats),
        error_samples=samples,
        load_cpu_percent=load_cpu,
        load_rss_mib=round(sum(load_rss) / 2**20, 1),
        emulator_cpu_percent=round(emulator_cpu * 100, 1),
        load_lag_p50_ms=_ms(statistics.median(lags)) if lags else None,
        load_lag_p99_ms=_ms(lag_p99),
        load_lag_max_ms=_ms(lag_max),
        load_late_sends=sum(one["late_sends"] for one in stats),
        load_bottleneck=bottleneck,
        aggregator_check_p99_ms=check_p99,
        aggregator_check_max=check_max,
        emulator_lag_max=emulator_max,
        emulator_slow_gcs=[
            [generation, round(when - measure_from, 2), _ms(took) or 0.0]
            for generation, when, took in emulator_gcs
            if when < measure_from + duration
        ],
        log_dir=log_dir,
    )


def table(results: list[Result]) -> str:
    header = (
        f"{'agents':>7} {'conns':>6} {'msg/s':>8} {'CPU %':>6} {'RSS MiB':>8} {'B/agent':>8} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'lag99':>6} {'lagmax':>7} {'late':>5} {'errors':>6} "
        f"{'holds':>5}"
    )
    lines = [header]
    for r in results:
        lines.append(
            f"{r.agents:>7} {r.connections:>6} {r.messages_per_s:>8} "
            f"{r.aggregator_cpu_percent:>6} {r.aggregator_rss_mib:>8} {r.bytes_per_agent:>8} "
            f"{r.latency_p50_ms!s:>7} {r.latency_p99_ms!s:>7} {r.load_lag_p99_ms!s:>6} "
            f"{r.load_lag_max_ms!s:>7} {r.load_late_sends:>5} {r.stream_errors:>6} "
            f"{'yes' if r.holds else 'no':>5}"
        )
        if r.load_bottleneck:
            lines.append(f"{'':>7} NOT A RESULT: the load generator was the bottleneck")
    return "\n".join(lines)
