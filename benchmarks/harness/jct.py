"""Job completion times of scheduling policies under arrival patterns (as `benchmarks.ssjf` compares them).

A scheduling policy changes the order requests run in, not what they write: it shows in the job completion
time (JCT: request sent to last token) and the makespan throughput, per arrival pattern. The patterns are a
burst (everything at once: the most there is to reorder, and the throughput the system has) and Poisson
streams at multiples of that throughput (a queue forms only above the rate the system keeps up with).

A run's figures (`figures`) are keyed the same on real and simulated engines, for the table (`table`)
and the bar chart (`plot`); `agreement` checks that the policies' answers did not change with the
order, and `reductions` pools the patterns into a policy's gain over a reference and an oracle's.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.arrivals import poisson_arrivals
from benchmarks.harness.output import fmt_num, markdown_table
from benchmarks.harness.stats import percentile
from benchmarks.harness.streaming import Answer
from benchmarks.plotting import pyplot, save

__all__ = [
    "BURST",
    "agreement",
    "figures",
    "headline",
    "of_answers",
    "patterns",
    "plot",
    "reductions",
    "table",
]

BURST = "burst"

# One arrival pattern's row: each system's figures (`figures`, and whatever else its run reports), and
# entries of the pattern as a whole (``outputs_identical``).
Row = Mapping[str, Any]


def patterns(
    n: int, capacity: float, multiples: Sequence[float], seeds: Sequence[int]
) -> dict[str, list[float]]:
    """``n`` arrival times per pattern: `BURST` (all at 0), then Poisson at each multiple of ``capacity``
    req/s (labelled ``"3x"``), the stream of ``multiples[i]`` drawn from ``seeds[i]``."""
    out = {BURST: [0.0] * n}
    out |= {f"{r:g}x": poisson_arrivals(n, r * capacity, s) for r, s in zip(multiples, seeds, strict=True)}
    return out


def figures(jcts: Sequence[float], makespan: float) -> dict[str, float]:
    """Mean and p90 JCT (seconds) and the makespan's throughput (requests per second) of one run."""
    return {
        "mean_jct_s": statistics.fmean(jcts),
        "p90_jct_s": percentile(jcts, 90),
        "throughput_rps": len(jcts) / makespan,
    }


def of_answers(answers: Sequence[Answer], makespan: float) -> dict[str, Any]:
    """`figures` of streamed answers, with the longest time to first token (``max_ttft_s``: how long a
    request waited, against an aging bound) and the answers' ``texts`` (for `agreement`)."""
    jcts = [a.jct_s for a in answers]
    return figures(jcts, makespan) | {
        "max_ttft_s": max(a.ttft_s for a in answers),
        "texts": [a.text for a in answers],
    }


def agreement(texts: Sequence[Sequence[str]]) -> float:
    """The share of requests that every run (one list of answers each, in request order) answered alike."""
    return statistics.fmean(len(set(t)) == 1 for t in zip(*texts, strict=True))


def reductions(by_pattern: Mapping[str, Row], reference: str, policy: str, oracle: str) -> dict[str, float]:
    """JCTs pooled over the arrival patterns: ``policy``'s and ``oracle``'s reduction against ``reference``,
    the policy's share of the oracle's, its p90 reduction and its mean throughput ratio."""
    total = {s: sum(p[s]["mean_jct_s"] for p in by_pattern.values()) for s in (reference, policy, oracle)}
    saved, best = total[reference] - total[policy], total[reference] - total[oracle]
    p90s = {s: sum(p[s]["p90_jct_s"] for p in by_pattern.values()) for s in (reference, policy)}
    return {
        "jct_reduction": saved / total[reference],
        "oracle_reduction": best / total[reference],
        "share_of_oracle": saved / best if best > 0 else float("nan"),
        "p90_reduction": 1 - p90s[policy] / p90s[reference],
        "throughput_ratio": statistics.fmean(
            p[policy]["throughput_rps"] / p[reference]["throughput_rps"] for p in by_pattern.values()
        ),
    }


def headline(r: Mapping[str, float], reference: str) -> str:
    """`reductions` in words: the mean JCT's change against ``reference``, the oracle's and the share."""
    oracle = f"oracle {-r['oracle_reduction']:+.1%}, share {r['share_of_oracle']:.0%}"
    return f"mean JCT {-r['jct_reduction']:+.1%} vs {reference} ({oracle})"


# Each figure's column heading.
HEADS = {
    "mean_jct_s": "mean JCT s",
    "p90_jct_s": "p90 JCT s",
    "throughput_rps": "req/s",
    "max_ttft_s": "max TTFT s",
}


def table(
    sections: Mapping[str, Mapping[str, Row]],
    systems: Sequence[str],
    keys: Sequence[str],
    section: str | None = None,
    same: bool = False,
) -> str:
    """Per section (a column headed ``section``; None: no such column), arrival pattern and system: the
    figures of ``keys``; ``same``: and the pattern's share of answers alike (``outputs_identical``)."""
    rows = [
        [*([name] if section else []), label, s, *(fmt_num(row[s][k], 2) for k in keys)]
        + ([f"{row['outputs_identical']:.0%}"] if same else [])
        for name, by_pattern in sections.items()
        for label, row in by_pattern.items()
        for s in systems
    ]
    lead = [section] if section else []
    heads = [*lead, "arrivals", "system", *(HEADS[k] for k in keys), *(["same"] if same else [])]
    return markdown_table(heads, rows, [False] * (len(lead) + 2) + [True] * (len(keys) + int(same)))


def plot(panels: Mapping[str, Mapping[str, Row]], systems: Sequence[str], title: str, path: Path) -> None:
    """Mean JCT per system (bars side by side) and arrival pattern, one panel per entry of ``panels``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    width = 0.81 / len(systems)
    for ax, (name, by_pattern) in zip(axes[0], panels.items(), strict=True):
        labels = list(by_pattern)
        for k, s in enumerate(systems):
            xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [by_pattern[lab][s]["mean_jct_s"] for lab in labels], width, label=s)
        ax.set(xticks=range(len(labels)), xticklabels=labels, ylabel="mean JCT (s)", title=name)
        ax.legend()
    fig.suptitle(title)
    save(fig, path)
