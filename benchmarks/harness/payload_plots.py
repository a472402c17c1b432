"""Figures drawn from the JSON payloads the harness writes: a latency as its median with its range as an
error bar (on a line or on grouped bars), a sweep of first jobs and timed runs (`first_jobs.Compared`), and
sweeps around a fixed point (`point_sweeps`).

A payload keeps a latency as a `benchmarks.harness.stats.Spread` (``median``, ``min``, ``max``, ...); a
plot draws the median and shows the range, so that a noisy point is seen as one (`whisker`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Whisker", "compared_sweep", "errorbar_line", "grouped_bars", "sweep_bars", "whisker"]

# A mark with its error bar: the height, and how far the bar reaches below and above it.
Whisker = tuple[float, float, float]


def whisker(spread: Mapping[str, Any]) -> Whisker:
    """A spread as a mark: its median, and its range below and above the median."""
    return spread["median"], spread["median"] - spread["min"], spread["max"] - spread["median"]


def _errors(marks: Sequence[Whisker]) -> list[list[float]]:
    return [[m[1] for m in marks], [m[2] for m in marks]]


def errorbar_line(ax: Any, xs: Sequence[float], spreads: Sequence[Mapping[str, Any]], label: str) -> None:
    """One system's median at each of ``xs`` as a line, its range as error bars."""
    marks = [whisker(s) for s in spreads]
    ax.errorbar(xs, [m[0] for m in marks], yerr=_errors(marks), marker="o", capsize=3, label=label)


def grouped_bars(
    ax: Any, labels: Sequence[str], bars: Mapping[str, Sequence[Whisker]], width: float = 0.38
) -> None:
    """Per label of the x axis a group of bars, one per system of ``bars`` (its marks in label order)."""
    for j, (name, marks) in enumerate(bars.items()):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [m[0] for m in marks], width, yerr=_errors(marks), capsize=3, label=name)
    ax.set_xticks(range(len(labels)), labels)


def compared_sweep(
    axes: Sequence[Any],
    rows: Sequence[Mapping[str, Any]],
    sim_rows: Sequence[Mapping[str, Any]],
    x: str,
    names: Sequence[str],
) -> bool:
    """A sweep of `first_jobs.Compared` payloads (each row: its size ``x``, ``first_jobs``, ``settings``) on
    three axes, one line per system: the median latency with its range (in the setting with the network
    delay where it was measured), the first job's exact KV peak, and the first job's seconds on the
    simulator (``sim_rows``). Whether the drawn setting had the delay."""
    rows, sim_rows = sorted(rows, key=lambda r: r[x]), sorted(sim_rows, key=lambda r: r[x])
    xs, sim_xs = [r[x] for r in rows], [r[x] for r in sim_rows]
    delay = any(s["network_delay"] for r in rows for s in r["settings"])
    settings = [next(s for s in r["settings"] if s["network_delay"] == delay) for r in rows]
    for name in names:
        errorbar_line(axes[0], xs, [s["clients"][name]["latency"] for s in settings], name)
        axes[1].plot(xs, [r["first_jobs"][name]["peak_blocks"] for r in rows], marker="o", label=name)
        axes[2].plot(sim_xs, [r["first_jobs"][name]["seconds"] for r in sim_rows], marker="o", label=name)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    return delay


def _point_whisker(client: Mapping[str, Any]) -> Whisker:
    # Jobs started together: from the mean latency up to the p90 over the jobs; else the range.
    if "p90" in client:
        mean = client["latency"]["median"]
        return mean, 0.0, max(0.0, client["p90"]["median"] - mean)
    return whisker(client["latency"])


def sweep_bars(axes: Sequence[Any], sweeps: Mapping[str, Mapping[str, Any]], clients: Sequence[str]) -> None:
    """Each sweep of a `point_sweeps.by_sweep` payload on its own axes: per point, each client's median
    latency as grouped bars, the range as error bars (jobs started together: from the mean up to the p90)."""
    for ax, sweep in zip(axes, sweeps.values(), strict=False):
        points = sweep["points"]
        bars = {name: [_point_whisker(p["clients"][name]) for p in points] for name in clients}
        grouped_bars(ax, [p["label"] for p in points], bars)
        ax.set(title=sweep["figure"], ylabel="end-to-end latency (s)")
        ax.legend()
