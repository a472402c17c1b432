"""The highest request rate a system sustains: open-loop runs at a rate on the simulator, and the search.

A rate is sustained when no request failed and the mean normalized latency (seconds per output token) is
within a bound. `at_rate` is one rate's run (a `RatePoint`: its normalized latencies, the cluster's work),
`measure` the same on a fresh simulated cluster of its own; `max_sustained_rate` searches the rates (a
doubling grid, then bisection in log space), one run per rate tried. The runs are `sim_runs.open_loop` on
virtual time; their tables and figure are `rate_tables`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.output import log
from benchmarks.harness.sim_runs import Call, SimServed, Work, open_loop, simulated
from benchmarks.harness.stats import percentile
from benchmarks.harness.systems import System

__all__ = ["RateGrid", "RatePoint", "Search", "Timed", "at_rate", "max_sustained_rate", "measure"]

# One request of a run: its arrival (seconds from the start), its output tokens and the call that sends it.
Timed = tuple[float, int, Call]


@dataclass
class RatePoint:
    """One system at one rate: the measured requests' normalized latencies (seconds per output token,
    arrival order), every request of the run (warm-up included), failures and the cluster's work."""

    system: str
    rate: float
    norm_latency: list[float]
    requests: int
    last_arrival_s: float
    work: Work
    failures: int = 0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.norm_latency) if self.norm_latency else math.nan

    @property
    def p50(self) -> float:
        return percentile(self.norm_latency, 50)

    @property
    def p90(self) -> float:
        return percentile(self.norm_latency, 90)

    @property
    def drain_s(self) -> float:
        """How long the run went on after the last arrival: a queue that grew through the run shows here."""
        return self.work.virtual_s - self.last_arrival_s

    def sustained(self, bound: float) -> bool:
        """No request failed and the mean normalized latency is within ``bound``."""
        return self.failures == 0 and bool(self.norm_latency) and self.mean <= bound

    def line(self, bound: float) -> str:
        """One line of progress."""
        w, verdict = self.work, "ok" if self.sustained(bound) else "over"
        return (
            f"  {self.system:<18} {self.rate:8.2f} req/s: mean {self.mean * 1e3:6.1f} ms/token, p90 "
            f"{self.p90 * 1e3:6.1f}, drain {self.drain_s:5.1f} s: {verdict} ({self.requests} requests, "
            f"{w.virtual_s:.1f} simulated s in {w.wall_s:.1f} wall s)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "requests": self.requests,
            "measured": len(self.norm_latency),
            "failures": self.failures,
            "mean_s_per_token": self.mean,
            "p50_s_per_token": self.p50,
            "p90_s_per_token": self.p90,
            "drain_s": self.drain_s,
            "virtual_s": self.work.virtual_s,
            "wall_s": self.work.wall_s,
            "engines": self.work.engines,
            "placements": self.work.placements,
        }


async def at_rate(served: SimServed, rate: float, calls: Sequence[Timed], warmup_s: float = 0.0) -> RatePoint:
    """An open-loop run of ``(arrival, output tokens, call)`` offered at ``rate``: every call's normalized
    latency (seconds per output token) but those arriving before ``warmup_s``; a call that fails is logged
    and counted (the rate is then not sustained)."""
    name = served.system.name
    got = await open_loop(
        served, [(at, call) for at, _, call in calls], lambda e: log(f"  {name} @ {rate:g}/s failed: {e!r}")
    )
    norm = [x / n for (at, n, _), x in zip(calls, got, strict=True) if at >= warmup_s and x is not None]
    last = calls[-1][0] if calls else 0.0
    return RatePoint(name, rate, norm, len(calls), last, served.work(), sum(x is None for x in got))


def measure(
    system: System,
    latency: Any,
    rate: float,
    calls: Callable[[SimServed], Sequence[Timed]],
    warmup_s: float,
    bound: float,
) -> RatePoint:
    """`at_rate` on a fresh simulated cluster of ``system`` timed by ``latency`` (its engines sharing the
    process's `sim_runs.MemoTokenizer`), offering the requests ``calls(served)`` makes; the point is logged
    against ``bound``."""
    from server.sim import run

    async def simulate() -> RatePoint:
        async with simulated(system, latency, memo=True) as served:
            return await at_rate(served, rate, calls(served), warmup_s)

    point = run(simulate())
    log(point.line(bound))
    return point


@dataclass(frozen=True)
class RateGrid:
    """Where the search looks: doubling from ``start`` (halving if it fails already) within ``[lo, hi]``,
    then ``bisect_steps`` bisections; ``fixed``: that one rate only."""

    start: float = 4.0
    hi: float = 256.0
    lo: float = 0.25
    bisect_steps: int = 3
    fixed: float | None = None


@dataclass
class Search:
    """Every rate tried for one system, the highest sustained (0: none) and the lowest not (inf: none)."""

    system: str
    points: list[RatePoint]
    best: float
    first_failed: float

    def point_at(self, rate: float) -> RatePoint | None:
        return next((p for p in self.points if p.rate == rate), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_sustained_rate": self.best,
            "first_failed_rate": self.first_failed,
            "runs": [p.as_dict() for p in self.points],
        }


def max_sustained_rate(
    system: str, measure: Callable[[float], RatePoint], grid: RateGrid, bound: float
) -> Search:
    """The highest rate ``system`` sustains within ``bound`` (`RatePoint.sustained`), ``measure`` giving
    one run per rate tried; the points come back sorted by rate. The answer is good to the last bracket
    (``first_failed / best``)."""
    points: list[RatePoint] = []

    def ok(rate: float) -> bool:
        points.append(measure(rate))
        return points[-1].sustained(bound)

    good, bad = 0.0, math.inf
    if grid.fixed is not None:
        good, bad = (grid.fixed, bad) if ok(grid.fixed) else (good, grid.fixed)
    elif ok(grid.start):
        good = grid.start
        while good * 2 <= grid.hi and ok(good * 2):
            good *= 2
        bad = good * 2 if good * 2 <= grid.hi else math.inf
    else:
        bad = grid.start
        while bad / 2 >= grid.lo and not ok(bad / 2):
            bad /= 2
        good = bad / 2 if bad / 2 >= grid.lo else 0.0
    if grid.fixed is None and good > 0 and math.isfinite(bad):
        for _ in range(grid.bisect_steps):
            mid = math.sqrt(good * bad)
            good, bad = (mid, bad) if ok(mid) else (good, mid)
    return Search(system, sorted(points, key=lambda p: p.rate), good, bad)
