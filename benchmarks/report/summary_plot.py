"""The summary plot: every headline ratio against the 1x baseline, the paper's figure and our goal.

What it shows is computed (`summary_rows`, pure) apart from how it is drawn (`draw_summary`), so it is
testable without pixels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.experiments import EXPERIMENTS, Experiment
from benchmarks.plotting import pyplot, save
from benchmarks.report.goals import Goal, finite, metric_goal, paper_range, plain_label, verdict_mark
from benchmarks.report.spreads import stored_spread


@dataclass(frozen=True)
class SummaryRow:
    """One headline ratio in the summary plot: ours, its stored spread, the paper's figure, our goal."""

    experiment: str
    label: str
    value: float
    spread: tuple[float, float] | None  # min-max over the run's repeats, where the results file stores it
    paper: tuple[float, float] | None  # the paper's figure (lo == hi) or range
    goal: Goal | None  # a speedup goal (at least ``goal.lo``)

    @property
    def passed(self) -> bool | None:
        """Whether ours meets the goal; None without one."""
        return None if self.goal is None else self.goal.met(self.value)


def summary_rows(
    records: Mapping[str, Mapping[str, Any]], experiments: Sequence[Experiment] = EXPERIMENTS
) -> list[SummaryRow]:
    """The summary plot's rows, in the paper's order: every headline ratio (unit ``x``) measured by a
    successful run for which the paper states a figure or the registry a speedup goal. Goals below 1x or
    upper bounds (a fraction, a ratio to stay under) are not speedups over a baseline: tables only."""
    rows = []
    for e in experiments:
        record = records.get(e.name)
        if not record or not record.get("ok"):
            continue
        metrics = record.get("metrics", {})
        for m in e.metrics:
            value, paper, goal = metrics.get(m.key), paper_range(m.paper), metric_goal(m)
            speedup_goal = goal if goal is not None and goal.is_speedup else None
            if m.unit != "x" or not finite(value) or (paper is None and speedup_goal is None):
                continue
            spread = stored_spread(record.get("payload"), value)
            rows.append(SummaryRow(e.name, plain_label(m), value, spread, paper, speedup_goal))
    return rows


# Labelled ticks of the log axis: the reader reads 0.5x, 1x, 2x off it without counting minor ticks.
_TICKS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def axis_limits(rows: Sequence[SummaryRow]) -> tuple[float, float]:
    """The x range that holds every bar, whisker, paper mark and goal, and the 1x baseline, with margin."""
    xs = [1.0]
    for r in rows:
        xs += [r.value, *(r.spread or ()), *(r.paper or ())]
        if r.goal is not None and r.goal.lo is not None:
            xs.append(r.goal.lo)
    lo, hi = min(xs) / 1.15, max(xs) * 1.3
    # Down to a labelled tick, so a ratio below 1x is read against one (0.5x) as well as the 1x line.
    return max([t for t in _TICKS if t <= lo] or [lo]), hi


def _right_label(r: SummaryRow) -> str:
    text = f"{r.value:.2f}x"
    if r.spread is not None:
        text += f" ({r.spread[0]:.2f}-{r.spread[1]:.2f})"
    if r.paper is not None:
        lo, hi = r.paper
        text += f" · paper {lo:g}x" if lo == hi else f" · paper {lo:g}-{hi:g}x"
    if r.goal is not None:
        text += f" · goal {r.goal.text} {verdict_mark(bool(r.passed))}"
    return text


def draw_summary(rows: Sequence[SummaryRow]) -> Any:
    """The summary figure of ``rows``: one horizontal bar each, top to bottom, from the 1x baseline to ours,
    with the stored spread as whiskers, the paper's figure and our goal as marks, the values on the right."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import NullFormatter

    n = len(rows)
    # Sized to the rows, so labels never overlap: about a third of an inch a row, plus title and legend.
    fig, ax = plt.subplots(figsize=(12, 1.9 + 0.34 * n))
    ys = list(range(n))
    # Bars start at the 1x baseline: a ratio below 1x (Parrot slower than what it is compared with) points
    # left of it instead of looking like a shorter win.
    colors = ["tab:orange" if r.passed is False else "tab:blue" for r in rows]
    ax.barh(ys, [r.value - 1.0 for r in rows], left=1.0, height=0.55, color=colors, zorder=2)
    spread = [(y, r.value, r.spread) for y, r in zip(ys, rows, strict=True) if r.spread is not None]
    if spread:
        ax.errorbar(
            [value for _, value, _ in spread],
            [y for y, _, _ in spread],
            # The printed value has three digits, so it may sit a hair outside a narrow spread: clamp.
            xerr=[[max(0.0, v - s[0]) for _, v, s in spread], [max(0.0, s[1] - v) for _, v, s in spread]],
            fmt="none",
            ecolor="black",
            elinewidth=1,
            capsize=3,
            zorder=4,
        )
    for y, r in zip(ys, rows, strict=True):
        if r.paper is not None and r.paper[0] == r.paper[1]:
            ax.plot([r.paper[0]], [y], "D", color="tab:red", ms=6, zorder=5)
        elif r.paper is not None:
            ax.plot(r.paper, [y, y], "|-", color="tab:red", lw=2.5, ms=10, mew=2.5, zorder=5)
        if r.goal is not None and r.goal.lo is not None:
            ax.plot([r.goal.lo], [y], "|", color="tab:green", ms=18, mew=3, zorder=5)
    for y in range(1, n):  # a thin rule where the experiment changes keeps each one's rows together
        if rows[y].experiment != rows[y - 1].experiment:
            ax.axhline(y - 0.5, color="0.85", lw=0.8, zorder=1)
    ax.axvline(1.0, color="black", lw=1.2, zorder=3)
    ax.set_xscale("log")
    lo, hi = axis_limits(rows)
    ax.set_xlim(lo, hi)
    ticks = [t for t in _TICKS if lo <= t <= hi]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="x", which="major", color="0.9", zorder=0)
    # Rows run top to bottom; the extra room above the first row holds the baseline's label.
    ax.set_ylim(n - 0.5, -1.3)
    ax.text(1.0, -0.85, " baseline", fontsize=8, va="center", ha="left")
    ax.set_yticks(ys, [f"{r.experiment}: {r.label}" for r in rows], fontsize=8)
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    right.set_yticks(ys, [_right_label(r) for r in rows], fontsize=8)
    ax.set_xlabel("Parrot vs what it is compared with (x, log scale; right of 1x: Parrot better)", fontsize=9)
    # The legend names only the marks this figure has, each once.
    marks = [
        (True, Patch(color="tab:blue", label="ours")),
        (any(r.passed is False for r in rows), Patch(color="tab:orange", label="ours, below its goal")),
        (bool(spread), Line2D([], [], color="black", lw=1, marker="|", ms=8, label="min-max over repeats")),
        (
            any(r.paper and r.paper[0] == r.paper[1] for r in rows),
            Line2D([], [], color="tab:red", marker="D", ls="", label="paper"),
        ),
        (
            any(r.paper and r.paper[0] != r.paper[1] for r in rows),
            Line2D([], [], color="tab:red", lw=2.5, marker="|", ms=10, mew=2.5, label="paper's range"),
        ),
        (
            any(r.goal for r in rows),
            Line2D([], [], color="tab:green", marker="|", ms=14, mew=3, ls="", label="our goal"),
        ),
        (True, Line2D([], [], color="black", lw=1.2, label="1x: the baseline")),
    ]
    handles = [handle for shown, handle in marks if shown]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Headline ratios: ours, the paper's figure, our goals", fontsize=10)
    return fig


def plot_summary(records: Mapping[str, Mapping[str, Any]], path: Path) -> bool:
    """Draw `summary_rows` of ``records`` to ``path``; False (nothing written) when there are none."""
    rows = summary_rows(records)
    if not rows:
        return False
    save(draw_summary(rows), path)
    return True
