"""Tables of simulated cluster runs: every rate a search tried, each system's highest sustained rate
against a reference's and the paper's ratio, and what the engines did (`sim_runs.Work`); and the figure of
the searches (`plot`: latency against rate, from the JSON payload).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness.output import markdown_table
from benchmarks.harness.rates import Search
from benchmarks.harness.sim_runs import Work
from benchmarks.harness.stats import safe_ratio
from benchmarks.plotting import pyplot, save

__all__ = ["engines_table", "plot", "rates_table", "report", "summary_table"]


def rates_table(searches: Mapping[str, Search], bound: float) -> str:
    """Every rate tried, per system: normalized latency (mean, p50, p90 in ms/token), drain, sustained."""
    rows = [
        [
            name,
            f"{p.rate:.2f}",
            f"{len(p.norm_latency)}/{p.requests}",
            *(f"{x * 1e3:.1f}" for x in (p.mean, p.p50, p.p90)),
            f"{p.drain_s:.1f}",
            f"{p.work.virtual_s:.1f}",
            f"{p.work.wall_s:.1f}",
            ("yes" if p.sustained(bound) else "no") + (f" ({p.failures} failed)" if p.failures else ""),
        ]
        for name, s in searches.items()
        for p in s.points
    ]
    headers = ["system", "rate req/s", "measured/all", "mean ms/token", "p50", "p90", "drain s"]
    headers += ["simulated s", "wall s", "sustained"]
    return markdown_table(headers, rows, [False, *([True] * 8), False])


def summary_table(searches: Mapping[str, Search], reference: str, anchors: Mapping[str, float]) -> str:
    """The highest sustained rate per system, its latency there, ``reference``'s rate over it, and the
    paper's ratio (``anchors`` by system)."""
    rows = []
    for name, s in searches.items():
        p, anchor = s.point_at(s.best), anchors.get(name)
        there = ["n/a", "n/a"] if p is None else [f"{p.mean * 1e3:.1f}", f"{p.p90 * 1e3:.1f}"]
        ratio = "" if name == reference else f"{safe_ratio(searches[reference].best, s.best):.2f}x"
        paper = "" if anchor is None else f"{anchor:g}x"
        rows.append([name, f"{s.best:.2f}", f"{s.first_failed:.2f}", *there, ratio, paper])
    headers = ["system", "max sustained req/s", "first failed", "mean ms/token there", "p90"]
    return markdown_table([*headers, f"{reference} / this", "paper"], rows, [False, *([True] * 6)])


def engines_table(works: Mapping[str, Work]) -> str:
    """Per system and engine: steps, busy time, prefill and decode tokens, decodes and milliseconds per
    step, preemptions and evictions; and per system the scheduler branches that placed its steps."""
    rows = []
    for name, w in works.items():
        placed = " ".join(f"{r}:{n}" for r, n in sorted(w.placed_by().items())) or "-"
        for i, e in enumerate(w.engines):
            rows.append(
                [
                    name if i == 0 else "",
                    str(i),
                    f"{e['steps']:,}",
                    f"{e['busy_s']:.1f} ({safe_ratio(e['busy_s'], w.virtual_s):.0%})",
                    f"{e['prefill_tokens_computed']:,}",
                    f"{e['decode_tokens_computed']:,}",
                    f"{safe_ratio(e['decode_tokens_computed'], e['steps']):.1f}",
                    f"{safe_ratio(e['busy_s'], e['steps']) * 1e3:.1f}",
                    f"{e['preemptions']}/{e['evictions']}",
                    placed if i == 0 else "",
                ]
            )
    headers = ["system", "engine", "steps", "busy s", "prefill tokens", "decode tokens", "decodes/step"]
    headers += ["ms/step", "preempt/evict", "placed by (steps)"]
    return markdown_table(headers, rows, [False, *([True] * 8), False])


def report(searches: Mapping[str, Search], reference: str, anchors: Mapping[str, float], bound: float) -> str:
    """A search per system as tables: every rate tried, the highest sustained (`summary_table`), the
    engines' work there, and the simulated time against the wall time it took."""
    at_best = {n: p.work for n, s in searches.items() if (p := s.point_at(s.best)) is not None}
    works = [p.work for s in searches.values() for p in s.points]
    virtual, wall = sum(w.virtual_s for w in works), sum(w.wall_s for w in works)
    return (
        f"{rates_table(searches, bound)}\n\n{summary_table(searches, reference, anchors)}\n\n"
        f"At each system's highest sustained rate:\n\n{engines_table(at_best)}\n\n"
        f"{len(works)} simulated runs: {virtual:.0f} simulated s in {wall:.0f} wall s"
    )


def plot(searches: Mapping[str, Mapping[str, Any]], bound: float, path: Path) -> None:
    """Mean normalized latency against request rate per system (`Search.as_dict` by name), the bound,
    each system's highest sustained rate."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, search in searches.items():
        runs = sorted(search["runs"], key=lambda r: r["rate"])
        (line,) = ax.plot([r["rate"] for r in runs], [1000 * r["mean_s_per_token"] for r in runs], "o-", ms=3)
        ax.axvline(search["max_sustained_rate"], color=line.get_color(), ls=":", lw=1)
        line.set_label(f"{name} (max {search['max_sustained_rate']:.1f} req/s)")
    ax.axhline(1000 * bound, color="grey", ls="--", lw=1, label="bound")
    ax.set(xscale="log", yscale="log", xlabel="request rate (req/s, simulated)")
    ax.set_ylabel("mean latency per output token (ms)")
    ax.legend(fontsize=7)
    save(fig, path)
