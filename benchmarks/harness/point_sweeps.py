"""Sweeps of one variable at a time around a fixed point, two clients compared at every point: the points,
their table, their ``RESULT`` metrics and their JSON payload grouped by sweep.

An experiment of this shape (`benchmarks.chain_summary`, paper Fig. 11-13) varies one size at a time —
output length, chunk size, a background load, concurrent apps — and measures both clients at each value.
A point's ratio is the slow client's median latency over the fast one's. A point of concurrent jobs (runs
made by `chains.together`) also has the p90 latency over its jobs, and per job the slow client's latency
minus the fast one's: whether every job, not only the mean, is answered first by the fast client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from benchmarks.harness import chains, measure
from benchmarks.harness.measure import Samples
from benchmarks.harness.output import markdown_table
from benchmarks.harness.stats import Spread, safe_ratio

__all__ = ["Point", "by_sweep", "speedup_metrics", "table"]


@dataclass
class Point:
    """One point of a sweep, both clients measured. A subclass names the sweeps (key -> the paper's figure
    and how a value reads, e.g. ``"{} tokens"``) and which client is the slow one and which the fast one."""

    sweeps: ClassVar[Mapping[str, tuple[str, str]]]
    slow: ClassVar[str]
    fast: ClassVar[str]

    sweep: str  # a key of `sweeps`
    value: int
    samples: dict[str, Samples]
    load: dict[str, int] = field(default_factory=dict)  # a background load's counts, if any

    @property
    def label(self) -> str:
        return self.sweeps[self.sweep][1].format(self.value)

    @property
    def figure(self) -> str:
        return self.sweeps[self.sweep][0]

    @property
    def ratio(self) -> measure.Ratio:
        return measure.ratio(self.samples[self.slow], self.samples[self.fast])

    @property
    def together(self) -> bool:
        """Whether the runs are of jobs started together (`chains.together`)."""
        runs = [r for s in self.samples.values() for r in s.runs]
        return bool(runs) and all(isinstance(r, chains.Together) for r in runs)

    def p90(self, client: str) -> Spread:
        """Jobs started together: the spread over runs of the p90 latency over the jobs."""
        return chains.percentile_spread(self.samples[client], 90)

    @property
    def speedup_p90(self) -> float:
        return safe_ratio(self.p90(self.slow).median, self.p90(self.fast).median)

    def per_job_difference(self) -> list[float]:
        """Jobs started together: per job, the slow client's median latency minus the fast one's."""
        return chains.per_job_difference(self.samples[self.slow], self.samples[self.fast])

    def base_dict(self) -> dict[str, Any]:
        """The point for the JSON payload: its value, every client's samples (jobs started together: with
        the p90), the ratio, and the load's counts (the request counter also counts the load's requests:
        no requests per job then)."""
        out = {"value": self.value, "label": self.label, "clients": measure.as_dicts(self.samples)}
        for name, client in out["clients"].items():
            if self.load:
                del client["requests"]
            if self.together:
                client["p90"] = self.p90(name).as_dict()
        return out | {"speedup": self.ratio.as_dict(), **self.load}


def table(points: Sequence[Point], clients: Sequence[str]) -> str:
    """One row per point (jobs started together: the mean and the p90): each client's median latency and
    the ratio."""

    def row(figure: str, label: str, spreads: list[Spread], speedup: str) -> list[str]:
        return [figure, label, *(f"{s.median:.3f} ±{s.rel_half_range:.0%}" for s in spreads), speedup]

    rows = []
    for p in points:
        spreads = [p.samples[n].spread for n in clients]
        if not p.together:
            rows.append(row(p.figure, p.label, spreads, str(p.ratio)))
            continue
        rows.append(row(f"{p.figure} (mean)", p.label, spreads, str(p.ratio)))
        rows.append(row(f"{p.figure} (p90)", p.label, [p.p90(n) for n in clients], f"{p.speedup_p90:.2f}x"))
    ratio = f"{points[0].slow} / {points[0].fast} (range)" if points else "ratio (range)"
    heads = ["figure", "point", *(f"{n} s" for n in clients), ratio]
    return markdown_table(heads, rows, [False, False, *([True] * (len(clients) + 1))])


def speedup_metrics(points: Sequence[Point]) -> dict[str, float]:
    """The headline range of speedups first, then each point's speedup, ``speedup_<sweep><value>`` (jobs
    started together: also of the p90, ``..._p90``)."""
    speedups: dict[str, float] = {}
    for p in points:
        speedups[f"speedup_{p.sweep}{p.value}"] = p.ratio.median
        if p.together:
            speedups[f"speedup_{p.sweep}{p.value}_p90"] = p.speedup_p90
    values = [v for v in speedups.values() if math.isfinite(v)]  # NaN (an unusable point): no headline
    return {
        "speedup_min": min(values, default=math.nan),
        "speedup_max": max(values, default=math.nan),
    } | speedups


def by_sweep(points: Sequence[Any], sweeps: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """The points for the JSON payload by sweep (each with its figure), every point by its ``as_dict``."""
    out: dict[str, Any] = {key: {"figure": figure, "points": []} for key, (figure, _) in sweeps.items()}
    for p in points:
        out[p.sweep]["points"].append(p.as_dict())
    return out
