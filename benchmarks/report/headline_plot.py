"""Each experiment's headline plot: bars of its headline metrics, with the paper's value or range."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.experiments import Experiment
from benchmarks.plotting import pyplot, save
from benchmarks.report.goals import paper_range


def plot_headline(e: Experiment, record: Mapping[str, Any], path: Path) -> bool:
    """Bars of the experiment's headline metrics, with the paper's value (or range) where it states one."""
    metrics = record.get("metrics", {})
    # A metric with no value is stored as null (`write_json`): not plotted.
    shown = [m for m in e.metrics if metrics.get(m.key) is not None and math.isfinite(metrics[m.key])]
    if not shown:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(shown), 3.2))
    xs = range(len(shown))
    ax.bar(xs, [metrics[m.key] for m in shown], color="tab:blue", label="ours")
    for x, m in zip(xs, shown, strict=True):
        span = paper_range(m.paper)
        if span is not None:
            ax.plot(
                [x - 0.4, x + 0.4], [span[1]] * 2, color="tab:red", lw=2, label="paper" if x == 0 else None
            )
            if span[0] != span[1]:
                ax.fill_between([x - 0.4, x + 0.4], span[0], span[1], color="tab:red", alpha=0.2)
    ax.set_xticks(list(xs), [m.label for m in shown], rotation=20, ha="right", fontsize=8)
    ax.set_title(f"{e.name} ({e.figure})", fontsize=9)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.legend(fontsize=7)
    save(fig, path)
    return True
