"""How slowly the emulated Kubernetes API answers, for ``bench/failover.py --api-latency``.

A distribution of answer delays, one independent draw per request (the emulator's
``KubeEmulator.slow`` with a function). Written as a spec on the command line:

- ``none``: no delay (the emulator answers as fast as it can);
- ``mix:LO-HI,FRACTION,SLOW_LO-SLOW_HI``: uniform between LO and HI seconds, except a
  FRACTION of the requests, uniform between SLOW_LO and SLOW_HI seconds. ``mix:0.02-0.05,0.01,1-3``
  answers 99 % of the requests in 20-50 ms and 1 % in 1-3 s: its p99 is 1 s;
- ``lognormal:MEDIAN,P99[,CAP]``: log-normal with that median and 99th percentile (seconds),
  draws above CAP (default 30 s) cut to CAP. ``lognormal:0.03,1`` has a heavier tail than the
  mix above (p99.9 3.2 s) and 10 % of its requests above 200 ms;
- ``p99-1s``: the mix above (docs/benchmarks.md, "Leader election on a slow API server");
  ``p99-1s-lognormal``: the log-normal above.

:class:`Recorder` keeps every draw, so a run reports the delays its requests actually got.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: 2.326...: the standard normal's 99th percentile.
Z99 = statistics.NormalDist().inv_cdf(0.99)
PRESETS = {
    "p99-1s": "mix:0.02-0.05,0.01,1-3",
    "p99-1s-lognormal": "lognormal:0.03,1",
}


@dataclass(frozen=True)
class Latency:
    """One distribution of answer delays (seconds); ``spec`` says which, as parsed."""

    spec: str
    kind: str  # none, mix, lognormal
    low: float = 0.0
    high: float = 0.0
    slow_fraction: float = 0.0
    slow_low: float = 0.0
    slow_high: float = 0.0
    median: float = 0.0
    p99: float = 0.0
    cap: float = 30.0

    @property
    def sigma(self) -> float:
        """The log-normal's sigma (of the logarithm), from its median and p99."""
        return math.log(self.p99 / self.median) / Z99

    def draw(self, rng: random.Random) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "mix":
            if rng.random() < self.slow_fraction:
                return rng.uniform(self.slow_low, self.slow_high)
            return rng.uniform(self.low, self.high)
        return min(self.cap, rng.lognormvariate(math.log(self.median), self.sigma))

    def sampler(self, seed: int) -> Callable[[], float]:
        rng = random.Random(seed)
        return lambda: self.draw(rng)

    def describe(self) -> str:
        if self.kind == "none":
            return "no delay"
        if self.kind == "mix":
            fast = 1 - self.slow_fraction
            return (
                f"{fast:.0%} of requests {self.low * 1000:g}-{self.high * 1000:g} ms, "
                f"{self.slow_fraction:.0%} {self.slow_low:g}-{self.slow_high:g} s"
            )
        return (
            f"log-normal, median {self.median * 1000:g} ms, p99 {self.p99:g} s "
            f"(sigma {self.sigma:.2f}, cut at {self.cap:g} s)"
        )


def _range(text: str, spec: str) -> tuple[float, float]:
    low, dash, high = text.partition("-")
    if not dash:
        raise ValueError(f"{spec!r}: {text!r} is not a range LO-HI (seconds)")
    values = float(low), float(high)
    if not 0 <= values[0] <= values[1]:
        raise ValueError(f"{spec!r}: range {text!r} must have 0 <= LO <= HI")
    return values


def parse(spec: str) -> Latency:
    """A spec (see the module's docstring) as a :class:`Latency`; ValueError if malformed."""
    text = PRESETS.get(spec, spec)
    kind, _, rest = text.partition(":")
    parts = [part.strip() for part in rest.split(",")] if rest else []
    try:
        if kind == "none" and not parts:
            return Latency(spec, "none")
        if kind == "mix" and len(parts) == 3:
            low, high = _range(parts[0], spec)
            slow_low, slow_high = _range(parts[2], spec)
            fraction = float(parts[1])
            if not 0 <= fraction <= 1:
                raise ValueError(f"{spec!r}: FRACTION must be between 0 and 1")
            return Latency(spec, "mix", low, high, fraction, slow_low, slow_high)
        if kind == "lognormal" and len(parts) in (2, 3):
            median, p99 = float(parts[0]), float(parts[1])
            cap = float(parts[2]) if len(parts) == 3 else 30.0
            if not 0 < median < p99 <= cap:
                raise ValueError(f"{spec!r}: needs 0 < MEDIAN < P99 <= CAP")
            return Latency(spec, "lognormal", median=median, p99=p99, cap=cap)
    except ValueError as error:
        if spec in str(error):
            raise
        raise ValueError(f"{spec!r}: {error}") from None
    raise ValueError(
        f"{spec!r} is not a latency: none, mix:LO-HI,FRACTION,SLOW_LO-SLOW_HI, "
        f"lognormal:MEDIAN,P99[,CAP], or one of {', '.join(PRESETS)}"
    )


@dataclass
class Recorder:
    """Draws from ``latency`` (seeded) and keeps every draw."""

    latency: Latency
    seed: int = 1
    draws: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sampler = self.latency.sampler(self.seed)

    def __call__(self) -> float:
        value = self._sampler()
        self.draws.append(value)
        return value

    def summary(self) -> dict[str, Any]:
        """Count, median, p99, p99.9, max and the share of draws of 1 s or more."""
        if not self.draws:
            return {"requests": 0}
        ordered = sorted(self.draws)

        def quantile(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

        return {
            "requests": len(ordered),
            "p50_s": quantile(0.5),
            "p99_s": quantile(0.99),
            "p999_s": quantile(0.999),
            "max_s": round(ordered[-1], 4),
            "share_at_least_1s": round(sum(1 for x in ordered if x >= 1.0) / len(ordered), 5),
        }
