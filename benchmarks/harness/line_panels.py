"""A figure of a shape several experiments draw: figures against a swept size (batch, turn), one panel per
figure, one line per system.

Every system keeps its own marker and line style in every panel, so that two systems with the same values
(a kernel ablation holds the same KV blocks as Parrot) stay visible as two lines, not one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.plotting import pyplot

__all__ = ["line_panels"]

_MARKERS = ("o", "s", "^", "D", "v")
_STYLES = ("-", "--", ":", "-.", (0, (5, 1)))


def line_panels(
    xs: Sequence[float],
    panels: Mapping[str, Mapping[str, Sequence[float]]],
    xlabel: str,
    figsize: tuple[float, float],
) -> tuple[Any, list[Any]]:
    """One panel per ``panels`` entry (its y label: each line's label and values at ``xs``), side by side,
    with a grid and ``xs`` as ticks; the figure and its axes, for the caller to add legends, a title and to
    save (`benchmarks.plotting.save`)."""
    fig, axes = pyplot().subplots(1, len(panels), figsize=figsize, squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels.items(), strict=True):
        for (label, ys), marker, style in zip(lines.items(), _MARKERS, _STYLES, strict=False):
            ax.plot(xs, ys, marker=marker, linestyle=style, label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel, xticks=xs)
        ax.grid(True, alpha=0.3)
    return fig, list(axes[0])
