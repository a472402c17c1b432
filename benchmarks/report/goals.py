"""What a run is held to and compared with: the goal a headline metric's registry label states, the
tolerance a record stores, and the paper's figure (a number or a range).

A headline metric whose label states a goal (``"... (goal >= 1.5)"``) and a record that stores a tolerance
(``max_error`` and ``tolerance``, as ``sim_validation`` does) get a `Check`, pass or fail; nothing else is
held to a goal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.experiments import Experiment, Metric


def paper_range(text: str | None) -> tuple[float, float] | None:
    """The number (or ``lo-hi`` range) a paper figure like ``"1.38-1.88x"`` or ``"12x"`` states."""
    if not text:
        return None
    match = re.fullmatch(r"\s*([\d.]+)(?:\s*-\s*([\d.]+))?\s*x?\s*", text)
    if match is None:
        return None
    lo = float(match.group(1))
    return lo, float(match.group(2) or lo)


def finite(value: Any) -> bool:
    """Whether ``value`` is a measured number: a metric with no value is stored as null (`write_json`), and
    NaN survives as NaN."""
    return isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True)
class Goal:
    """A goal a headline metric is held to, as its registry label states it: ``(goal >= 1.5)``,
    ``(goal <= 1.10)``, ``(goal 1.42)`` (a figure to reach: at least it) or ``(goal 1.1-1.7)`` (a range to
    reach: at least its low end; beating a speedup range is no failure)."""

    lo: float | None  # at least this (None: no lower bound)
    hi: float | None  # at most this (None: no upper bound)
    text: str  # as stated, for the page ("≥ 1.5", "1.1-1.7")

    def met(self, value: float) -> bool:
        """Whether ``value`` meets the goal."""
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)

    @property
    def is_speedup(self) -> bool:
        """A lower bound of at least 1x: a speedup to reach, which the summary plot can draw on its axis."""
        return self.lo is not None and self.lo >= 1.0 and self.hi is None


_GOAL = re.compile(r"\(goal\s+(?:(>=|<=)\s*([\d.]+)|([\d.]+)(?:\s*-\s*([\d.]+))?)\s*\)")


def metric_goal(metric: Metric) -> Goal | None:
    """The goal ``metric``'s label states (``"... (goal >= 1.5)"``), or None: no goal is assumed."""
    match = _GOAL.search(metric.label)
    if match is None:
        return None
    op, bound, lo, hi = match.groups()
    if op == ">=":
        return Goal(float(bound), None, f"≥ {bound}")
    if op == "<=":
        return Goal(None, float(bound), f"≤ {bound}")
    return Goal(float(lo), None, f"{lo}-{hi}" if hi else f"≥ {lo}")


def plain_label(metric: Metric) -> str:
    """``metric``'s label without its ``(goal ...)`` note (the plot draws the goal instead)."""
    return _GOAL.sub("", metric.label).strip()


@dataclass(frozen=True)
class Check:
    """One verdict on a record: a metric against its goal, or an error against the stored tolerance."""

    key: str  # the metric checked
    passed: bool
    text: str  # for the summary table: "✗ speedup 0.984, goal ≥ 1.42"
    short: str  # for the metric's own row: "✗ goal ≥ 1.42"


def tolerance_check(metrics: Mapping[str, Any]) -> Check | None:
    """``max_error`` against the record's own ``tolerance`` (sim_validation's convention), or None when the
    record stores no tolerance. The script's ``within`` verdict wins where stored: it compared unrounded
    figures, the RESULT line keeps three digits."""
    error, tolerance = metrics.get("max_error"), metrics.get("tolerance")
    if not (finite(error) and finite(tolerance)):
        return None
    within = metrics.get("within")
    passed = bool(within) if finite(within) else error <= tolerance
    bound = f"{'within' if passed else 'above'} tolerance {tolerance * 100:.3g}%"
    return Check(
        "max_error",
        passed,
        f"{verdict_mark(passed)} max error {error * 100:.3g}% {bound}",
        f"{verdict_mark(passed)} {bound}",
    )


def verdict_mark(passed: bool) -> str:
    """The page's verdict sign: ✓ passed, ✗ failed."""
    return "✓" if passed else "✗"


def checks(e: Experiment, record: Mapping[str, Any] | None) -> list[Check]:
    """Every goal and tolerance verdict ``record`` allows: none for a missing or failed run, and none for a
    metric with no goal stated or no value measured."""
    if not record or not record.get("ok"):
        return []
    metrics = record.get("metrics", {})
    out = []
    for m in e.metrics:
        goal, value = metric_goal(m), metrics.get(m.key)
        if goal is not None and finite(value):
            passed = goal.met(value)
            mark = verdict_mark(passed)
            text = f"{mark} {m.key} {value:.3g}, goal {goal.text}"
            out.append(Check(m.key, passed, text, f"{mark} goal {goal.text}"))
    tolerance = tolerance_check(metrics)
    return out if tolerance is None else [*out, tolerance]
